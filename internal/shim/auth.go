package shim

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"k8s.io/apiserver/pkg/authentication/authenticator"
	"k8s.io/apiserver/pkg/authentication/group"
	"k8s.io/apiserver/pkg/authentication/request/bearertoken"
	"k8s.io/apiserver/pkg/authentication/request/union"
	"k8s.io/apiserver/pkg/authentication/token/tokenfile"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/authorization/authorizer"
)

// healthPaths are served to anonymous clients (probes); everything else needs a token.
var healthPaths = []string{"/healthz", "/livez", "/readyz"}

func isHealthPath(p string) bool {
	for _, h := range healthPaths {
		if p == h || strings.HasPrefix(p, h+"/") {
			return true
		}
	}
	return false
}

// healthAnonymous authenticates requests for the health paths as system:anonymous and
// declines everything else, so those get 401.
type healthAnonymous struct{}

func (healthAnonymous) AuthenticateRequest(req *http.Request) (*authenticator.Response, bool, error) {
	if !isHealthPath(req.URL.Path) {
		return nil, false, nil
	}
	return &authenticator.Response{User: &user.DefaultInfo{
		Name: user.Anonymous, Groups: []string{user.AllUnauthenticated},
	}}, true, nil
}

// newAuthenticator accepts the bearer tokens of a kube-apiserver static token file
// (token,user,uid,"group1,group2"), or of tokens when no file is given.
func newAuthenticator(tokenFile string, tokens map[string]*user.DefaultInfo) (authenticator.Request, error) {
	var tokenAuth authenticator.Token
	switch {
	case tokenFile != "":
		a, err := tokenfile.NewCSV(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-auth-file: %w", err)
		}
		tokenAuth = a
	case len(tokens) > 0:
		tokenAuth = tokenfile.New(tokens)
	default:
		return nil, fmt.Errorf("no tokens: set --token-auth-file (authentication is always on)")
	}
	bearer := group.NewAuthenticatedGroupAdder(bearertoken.New(tokenAuth))
	return union.New(bearer, healthAnonymous{}), nil
}

// authenticatedOnly admits every authenticated user and, for anonymous users, only
// the health paths.
func authenticatedOnly() authorizer.Authorizer {
	return authorizer.AuthorizerFunc(func(_ context.Context, a authorizer.Attributes) (authorizer.Decision, string, error) {
		u := a.GetUser()
		if u == nil {
			return authorizer.DecisionDeny, "no user", nil
		}
		if u.GetName() == user.Anonymous || slices.Contains(u.GetGroups(), user.AllUnauthenticated) {
			if !a.IsResourceRequest() && isHealthPath(a.GetPath()) {
				return authorizer.DecisionAllow, "", nil
			}
			return authorizer.DecisionDeny, "anonymous access is limited to health checks", nil
		}
		return authorizer.DecisionAllow, "", nil
	})
}
