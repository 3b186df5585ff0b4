package evidence

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"

	intoto "github.com/in-toto/attestation/go/v1"
	"github.com/secure-systems-lab/go-securesystemslib/dsse"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
)

// PayloadType is the DSSE payload type of an in-toto Statement.
const PayloadType = "application/vnd.in-toto+json"

// SubjectDigestAlgorithm is the subject's digest algorithm.
const SubjectDigestAlgorithm = "sha256"

// ParsePrivateKey reads a PKCS#8 PEM private key ("PRIVATE KEY"): ed25519 or ECDSA
// P-256. The error never quotes the file.
func ParsePrivateKey(data []byte) (crypto.Signer, error) {
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "PRIVATE KEY" {
		return nil, errors.New("the signing key is not a PEM \"PRIVATE KEY\" block (PKCS#8); convert it with: openssl pkcs8 -topk8 -nocrypt -in KEY")
	}
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the signing key is not a PKCS#8 private key: %v", err)
	}
	switch k := k.(type) {
	case ed25519.PrivateKey:
		return k, nil
	case *ecdsa.PrivateKey:
		if k.Curve != elliptic.P256() {
			return nil, fmt.Errorf("the signing key is ECDSA on %s; use P-256 or ed25519", k.Curve.Params().Name)
		}
		return k, nil
	}
	return nil, fmt.Errorf("the signing key is a %T; use ed25519 or ECDSA P-256", k)
}

// ParsePublicKey reads a PKIX PEM public key ("PUBLIC KEY"): ed25519 or ECDSA P-256.
func ParsePublicKey(data []byte) (crypto.PublicKey, error) {
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "PUBLIC KEY" {
		return nil, errors.New("the public key is not a PEM \"PUBLIC KEY\" block; derive it with: openssl pkey -pubout -in KEY")
	}
	k, err := x509.ParsePKIXPublicKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the public key does not parse: %v", err)
	}
	switch k := k.(type) {
	case ed25519.PublicKey:
		return k, nil
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			return nil, fmt.Errorf("the public key is ECDSA on %s; use P-256 or ed25519", k.Curve.Params().Name)
		}
		return k, nil
	}
	return nil, fmt.Errorf("the public key is a %T; use ed25519 or ECDSA P-256", k)
}

// KeyID is "sha256:<hex>" of a public key's PKIX DER encoding: the envelope's keyid.
func KeyID(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(der)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// signerVerifier is a dsse.Signer and dsse.Verifier over the standard library's
// ed25519 (the DSSE pre-authentication encoding signed as it is) and ECDSA P-256
// (its SHA-256, ASN.1 signature). Only public is set for verifying.
type signerVerifier struct {
	private crypto.Signer
	public  crypto.PublicKey
	id      string
}

func newSignerVerifier(private crypto.Signer, public crypto.PublicKey) (*signerVerifier, error) {
	id, err := KeyID(public)
	if err != nil {
		return nil, err
	}
	return &signerVerifier{private: private, public: public, id: id}, nil
}

func (s *signerVerifier) Sign(_ context.Context, data []byte) ([]byte, error) {
	switch k := s.private.(type) {
	case ed25519.PrivateKey:
		return ed25519.Sign(k, data), nil
	case *ecdsa.PrivateKey:
		sum := sha256.Sum256(data)
		return ecdsa.SignASN1(rand.Reader, k, sum[:])
	}
	return nil, fmt.Errorf("no signing key")
}

func (s *signerVerifier) Verify(_ context.Context, data, sig []byte) error {
	switch k := s.public.(type) {
	case ed25519.PublicKey:
		if ed25519.Verify(k, data, sig) {
			return nil
		}
	case *ecdsa.PublicKey:
		sum := sha256.Sum256(data)
		if ecdsa.VerifyASN1(k, sum[:], sig) {
			return nil
		}
	}
	return errors.New("signature does not verify")
}

func (s *signerVerifier) KeyID() (string, error)   { return s.id, nil }
func (s *signerVerifier) Public() crypto.PublicKey { return s.public }

// Statement wraps a predicate in an in-toto v1 Statement whose subject is the cluster
// (name: its id, or "unidentified:<etcd prefix>") with the predicate's digest and the
// revision as an annotation.
func Statement(p *Predicate) (*intoto.Statement, error) {
	digest, err := p.Digest()
	if err != nil {
		return nil, err
	}
	raw, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	pred := &structpb.Struct{}
	if err := protojson.Unmarshal(raw, pred); err != nil {
		return nil, err
	}
	ann, err := structpb.NewStruct(map[string]any{"etcdRevision": fmt.Sprint(p.Revision), "etcdPrefix": p.Cluster.EtcdPrefix})
	if err != nil {
		return nil, err
	}
	st := &intoto.Statement{
		Type:          intoto.StatementTypeUri,
		Subject:       []*intoto.ResourceDescriptor{{Name: SubjectName(p.Cluster), Digest: map[string]string{SubjectDigestAlgorithm: digest}, Annotations: ann}},
		PredicateType: PredicateType,
		Predicate:     pred,
	}
	return st, st.Validate()
}

// SubjectName is the subject's name for a cluster.
func SubjectName(c Cluster) string {
	if c.ID == "" {
		return "unidentified:" + c.EtcdPrefix
	}
	return c.ID
}

// Sign makes the DSSE envelope of p's Statement, signed with key, as the bytes of a
// file: compact JSON and a newline (Verify accepts exactly that form).
func Sign(ctx context.Context, p *Predicate, key crypto.Signer) ([]byte, error) {
	st, err := Statement(p)
	if err != nil {
		return nil, err
	}
	payload, err := protojson.Marshal(st)
	if err != nil {
		return nil, err
	}
	sv, err := newSignerVerifier(key, key.Public())
	if err != nil {
		return nil, err
	}
	es, err := dsse.NewEnvelopeSigner(sv)
	if err != nil {
		return nil, err
	}
	env, err := es.SignPayload(ctx, PayloadType, payload)
	if err != nil {
		return nil, err
	}
	return encodeEnvelope(env)
}

func encodeEnvelope(env *dsse.Envelope) ([]byte, error) {
	b, err := json.Marshal(env)
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Verified is what Verify found in a valid envelope.
type Verified struct {
	KeyID     string
	Subject   string
	Digest    string
	Predicate *Predicate
}

// Verify checks an envelope file offline against a public key: the file is exactly
// the form Sign writes (so no byte of it can change without failing), the signature
// verifies over the DSSE pre-authentication encoding, the payload is an in-toto v1
// Statement of rekey's predicate type, and the subject's digest is the predicate's.
func Verify(ctx context.Context, file []byte, pub crypto.PublicKey) (*Verified, error) {
	var env dsse.Envelope
	dec := json.NewDecoder(bytes.NewReader(file))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil {
		return nil, fmt.Errorf("not a DSSE envelope: %v", err)
	}
	if canon, err := encodeEnvelope(&env); err != nil || !bytes.Equal(canon, file) {
		return nil, errors.New("the envelope is not in the form rekey evidence writes (compact JSON and one newline): it was changed")
	}
	if env.PayloadType != PayloadType {
		return nil, fmt.Errorf("payload type %q, want %q", env.PayloadType, PayloadType)
	}
	if len(env.Signatures) != 1 {
		return nil, fmt.Errorf("%d signatures, want 1", len(env.Signatures))
	}
	for _, s := range []string{env.Payload, env.Signatures[0].Sig} {
		if raw, err := base64.StdEncoding.DecodeString(s); err != nil || base64.StdEncoding.EncodeToString(raw) != s {
			return nil, errors.New("the payload or signature is not canonical standard base64: it was changed")
		}
	}
	sv, err := newSignerVerifier(nil, pub)
	if err != nil {
		return nil, err
	}
	if env.Signatures[0].KeyID != sv.id {
		return nil, fmt.Errorf("signed by key %s, not by the public key given (%s)", env.Signatures[0].KeyID, sv.id)
	}
	ev, err := dsse.NewEnvelopeVerifier(sv)
	if err != nil {
		return nil, err
	}
	_, payload, err := ev.VerifyAndDecode(ctx, &env)
	if err != nil {
		return nil, fmt.Errorf("the signature does not verify with key %s: %v", sv.id, err)
	}
	var st intoto.Statement
	if err := protojson.Unmarshal(payload, &st); err != nil {
		return nil, fmt.Errorf("the signed payload is not an in-toto Statement: %v", err)
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("the signed Statement is not valid: %v", err)
	}
	if st.GetType() != intoto.StatementTypeUri || st.GetPredicateType() != PredicateType {
		return nil, fmt.Errorf("statement type %q with predicate type %q, want %q and %q", st.GetType(), st.GetPredicateType(), intoto.StatementTypeUri, PredicateType)
	}
	if len(st.GetSubject()) != 1 {
		return nil, fmt.Errorf("%d subjects, want 1", len(st.GetSubject()))
	}
	raw, err := protojson.Marshal(st.GetPredicate())
	if err != nil {
		return nil, err
	}
	var p Predicate
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, fmt.Errorf("the predicate is not rekey's evidence: %v", err)
	}
	digest, err := p.Digest()
	if err != nil {
		return nil, err
	}
	subj := st.GetSubject()[0]
	if got := subj.GetDigest()[SubjectDigestAlgorithm]; got != digest {
		return nil, fmt.Errorf("the subject's sha256 %q is not the predicate's %s", got, digest)
	}
	if subj.GetName() != SubjectName(p.Cluster) {
		return nil, fmt.Errorf("the subject %q is not the predicate's cluster %q", subj.GetName(), SubjectName(p.Cluster))
	}
	return &Verified{KeyID: sv.id, Subject: subj.GetName(), Digest: digest, Predicate: &p}, nil
}
