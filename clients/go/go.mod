module checkpointq/clients/go

go 1.19

require github.com/klauspost/compress v1.15.12

// Tests only (the redigo adapter in redigo_test.go; lib/pq, the driver the PostgreSQL store
// tests read the database with: the package itself imports only database/sql).
require (
	github.com/gomodule/redigo v1.8.3
	github.com/lib/pq v1.10.7
)
