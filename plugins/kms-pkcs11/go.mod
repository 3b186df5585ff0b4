module github.com/rekey-io/rekey/plugins/kms-pkcs11

go 1.26.0

replace github.com/rekey-io/rekey => ../..

require (
	github.com/ThalesGroup/crypto11 v1.6.2
	github.com/miekg/pkcs11 v1.1.2
)

require (
	github.com/pkg/errors v0.9.1 // indirect
	github.com/thales-e-security/pool v0.0.2 // indirect
)
