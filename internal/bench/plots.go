package bench

// The charts several scenarios draw on; each scenario's own chart is in its file.

// headlinePlot puts a row on the README's chart: KMS v2 and reload latency against
// upstream.
func headlinePlot(x string) Plot {
	return Plot{Chart: "headline", Title: "rekey vs upstream k8s.io/apiserver: KMS v2 and config reload latency", X: x, Series: "rekey", Against: 1}
}

// cipherFloorPlot compares rekey with one AES-256-GCM seal or open plus its output
// allocation: a bar near 1× means rekey adds almost nothing to the cipher.
func cipherFloorPlot(x, series string) Plot {
	return Plot{Chart: "cipher-floor", Title: "How close rekey gets to raw AES-256-GCM (serial)", X: x, Series: series, Against: 2}
}
