module checkpointq/clients/go

go 1.19

require github.com/klauspost/compress v1.15.12

// Tests only (the redigo adapter in redigo_test.go).
require github.com/gomodule/redigo v1.8.3
