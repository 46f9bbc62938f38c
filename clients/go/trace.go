package checkpointq

import (
	"context"
	"fmt"
	"regexp"
)

// TraceHeaders returns the trace context a request carries to the worker, for the context
// of the Save or Delete that sends it: W3C Trace Context ("traceparent", "tracestate") and
// W3C Baggage ("baggage"), exactly as an OpenTelemetry propagator injects them (a
// propagation.MapCarrier is a map[string]string). They travel as message headers, where
// Celery's own producers put them, so the worker's task.request carries them and
// OpenTelemetry's Celery instrumentation continues the trace. Other keys a propagator
// adds are not carried.
type TraceHeaders func(ctx context.Context) map[string]string

// traceKeys are the headers carried, in the order they are written.
var traceKeys = []string{"traceparent", "tracestate", "baggage"}

// traceLimits bound each header (W3C: tracestate holds at most 32 members of 256 bytes and
// should stay within 512 bytes; baggage within 8192 bytes).
var traceLimits = map[string]int{"traceparent": 55, "tracestate": 512, "baggage": 8192}

// traceparent is W3C Trace Context's header: version 00, a 16-byte trace id and an 8-byte
// parent id in lowercase hex, neither all zeros, and the flags.
var traceparent = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$`)

// traceHeaderFields renders the carried headers as JSON object members, each preceded by a
// comma, for buildEnvelope; an invalid one is an ErrInvalidInput, before anything is sent.
func traceHeaderFields(headers map[string]string) ([]byte, error) {
	var fields []byte
	for _, key := range traceKeys {
		value, ok := headers[key]
		if !ok || value == "" {
			continue
		}
		if len(value) > traceLimits[key] {
			return nil, fmt.Errorf("%w: the %s header is %d bytes; the limit is %d",
				ErrInvalidInput, key, len(value), traceLimits[key])
		}
		if key == "traceparent" && (!traceparent.MatchString(value) ||
			value[3:35] == "00000000000000000000000000000000" || value[36:52] == "0000000000000000") {
			return nil, fmt.Errorf("%w: %q is not a W3C traceparent (00-<trace id>-<parent id>-<flags>)",
				ErrInvalidInput, value)
		}
		fields = append(fields, ',')
		fields = append(fields, jsonString(key)...)
		fields = append(fields, ':')
		fields = append(fields, jsonString(value)...)
	}
	return fields, nil
}
