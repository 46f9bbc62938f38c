package checkpointq

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/klauspost/compress/zstd"
)

// maxDecompressed bounds a decompressed checkpoint (store/codec.py's default).
const maxDecompressed = 64 << 20

var zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}

// decoder is shared: DecodeAll is safe for concurrent use.
var decoder, _ = zstd.NewReader(nil, zstd.WithDecoderMaxMemory(maxDecompressed), zstd.WithDecoderConcurrency(0))

// decodeValue returns the JSON of a stored value: a zstd frame (what the workers and the Go
// RedisStore write) or plain JSON (what older Go deployments wrote).
func decodeValue(stored []byte) ([]byte, error) {
	if bytes.HasPrefix(stored, zstdMagic) {
		doc, err := decoder.DecodeAll(stored, nil)
		if err != nil {
			return nil, fmt.Errorf("broken zstd frame: %w", err)
		}
		return doc, nil
	}
	trimmed := bytes.TrimLeft(stored, " \t\r\n")
	if len(trimmed) > 0 && trimmed[0] == '{' {
		return stored, nil
	}
	return nil, errors.New("value is neither a zstd frame nor JSON")
}
