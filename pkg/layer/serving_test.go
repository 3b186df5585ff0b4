package layer

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apiserver/pkg/endpoints/request"
	genericfilters "k8s.io/apiserver/pkg/server/filters"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

func TestTimeServingTimesAnsweredRequestsOnly(t *testing.T) {
	var timed []time.Duration
	var classes []pace.RequestClass
	h := timeServing(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}),
		genericfilters.BasicLongRunningRequestCheck(sets.NewString("watch", "proxy"), sets.NewString("log", "exec")),
		func(c pace.RequestClass, d time.Duration) { timed, classes = append(timed, d), append(classes, c) })

	serve := func(info *request.RequestInfo, arrived time.Time) {
		r := httptest.NewRequest(http.MethodGet, "/api/v1/namespaces/default/secrets", nil)
		ctx := r.Context()
		if info != nil {
			ctx = request.WithRequestInfo(ctx, info)
		}
		if !arrived.IsZero() {
			ctx = request.WithReceivedTimestamp(ctx, arrived)
		}
		h.ServeHTTP(httptest.NewRecorder(), r.WithContext(ctx))
	}
	get := &request.RequestInfo{IsResourceRequest: true, Verb: "get", Resource: "secrets", Name: "a"}
	serve(get, time.Now().Add(-time.Second))
	if len(timed) != 1 || timed[0] < time.Second {
		t.Fatalf("timed %v, want one request of at least the 1s since it arrived", timed)
	}
	serve(&request.RequestInfo{IsResourceRequest: true, Verb: "watch", Resource: "secrets"}, time.Now())
	serve(&request.RequestInfo{IsResourceRequest: true, Verb: "get", Resource: "pods", Subresource: "log"}, time.Now())
	serve(nil, time.Now())
	if len(timed) != 1 {
		t.Fatalf("timed %d requests; watches, long-running subresources and unresolved requests are not timed", len(timed))
	}
	serve(get, time.Time{})
	if len(timed) != 2 {
		t.Fatalf("a request without its arrival time was not timed")
	}

	// Each request is timed in its class: a LIST is never judged against GETs.
	classes = classes[:0]
	for _, info := range []*request.RequestInfo{
		{IsResourceRequest: true, Verb: "list", Resource: "secrets"},
		{IsResourceRequest: true, Verb: "update", Resource: "secrets", Name: "a"},
		{IsResourceRequest: true, Verb: "deletecollection", Resource: "secrets"},
		{IsResourceRequest: false, Verb: "get", Path: "/readyz"},
		get,
	} {
		serve(info, time.Now())
	}
	want := []pace.RequestClass{pace.RequestList, pace.RequestWrite, pace.RequestList, pace.RequestOther, pace.RequestRead}
	if !slices.Equal(classes, want) {
		t.Errorf("classes %v, want %v", classes, want)
	}
}
