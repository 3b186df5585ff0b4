package kmsplugin

//lint:file-ignore SA1019 KMS v1 (k8s.io/kms/apis/v1beta1) is deprecated upstream; this file speaks it on purpose, so clusters still holding v1 values can be read and moved off it.

import (
	"bytes"
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kmsv1api "k8s.io/kms/apis/v1beta1"
)

// APIVersionV1 serves the KMS v1 API (k8s.io/kms/apis/v1beta1) instead of KMS v2
// (Options.APIVersion): what clusters created before KMS v2 still have values under.
// rekey only reads through it; kube-apiserver with --feature-gates=KMSv1=true also
// writes through it, which is how tests produce upstream-written KMS v1 data.
const APIVersionV1 = "v1"

// v1beta1Version is the API version a KMS v1 plugin reports and its clients send.
const v1beta1Version = "v1beta1"

// v1Service is the KMS v1 face of a Plugin. KMS v1 has no key id: a v1 ciphertext
// carries the name of the key that wrapped it, key name ‖ ':' ‖ nonce(12) ‖
// AES-256-GCM(DEK, the key name as authenticated data), so keys can rotate in the keys
// file and old DEKs still decrypt. Faults and Stats apply as for KMS v2 (Version counts
// as Status).
type v1Service struct {
	kmsv1api.UnimplementedKeyManagementServiceServer
	p *Plugin
}

func (s v1Service) Version(ctx context.Context, _ *kmsv1api.VersionRequest) (*kmsv1api.VersionResponse, error) {
	s.p.stats.status.Add(1)
	if _, err := s.p.inject(ctx, s.p.faults.Load().FailStatus, "Version"); err != nil {
		return nil, err
	}
	return &kmsv1api.VersionResponse{Version: v1beta1Version, RuntimeName: "rekey-kms-plugin", RuntimeVersion: "0.1.0"}, nil
}

func (s v1Service) Encrypt(ctx context.Context, req *kmsv1api.EncryptRequest) (*kmsv1api.EncryptResponse, error) {
	s.p.stats.encrypt.Add(1)
	ring, err := s.begin(ctx, s.p.faults.Load().FailEncrypt, "Encrypt")
	if err != nil {
		return nil, err
	}
	head := ring.active + ":"
	out := make([]byte, len(head), len(head)+12+len(req.Plain)+16)
	copy(out, head)
	// Seal draws the nonce: name ":" nonce(12) ‖ ciphertext ‖ tag.
	return &kmsv1api.EncryptResponse{Cipher: ring.aeads[ring.active].Seal(out, nil, req.Plain, []byte(ring.active))}, nil
}

func (s v1Service) Decrypt(ctx context.Context, req *kmsv1api.DecryptRequest) (*kmsv1api.DecryptResponse, error) {
	s.p.stats.decrypt.Add(1)
	ring, err := s.begin(ctx, s.p.faults.Load().FailDecrypt, "Decrypt")
	if err != nil {
		return nil, err
	}
	i := bytes.IndexByte(req.Cipher, ':')
	if i <= 0 {
		return nil, status.Error(codes.InvalidArgument, "kms-plugin: the v1 ciphertext does not start with a key name")
	}
	name, sealed := string(req.Cipher[:i]), req.Cipher[i+1:]
	a, ok := ring.aeads[name]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "kms-plugin: unknown key %q; it is not in the keys file", name)
	}
	if len(sealed) < 12+16 {
		return nil, status.Error(codes.InvalidArgument, "kms-plugin: ciphertext is too short")
	}
	pt, err := a.Open(nil, nil, sealed, []byte(name))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "kms-plugin: ciphertext does not decrypt under key %q", name)
	}
	return &kmsv1api.DecryptResponse{Plain: pt}, nil
}

// begin applies the faults of method and returns the keyring it answers with.
func (s v1Service) begin(ctx context.Context, fail bool, method string) (*keyring, error) {
	if _, err := s.p.inject(ctx, fail, method); err != nil {
		return nil, err
	}
	ring, err := s.p.keys()
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "kms-plugin: %v", err)
	}
	return ring, nil
}
