package server_test

import (
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/inuse"
)

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }

func kmsv2HashForTest(keyID string) string { return inuse.HashKeyID(keyID) }
