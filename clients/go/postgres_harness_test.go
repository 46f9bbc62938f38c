package checkpointq

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	_ "github.com/lib/pq" // the PostgreSQL driver the tests read the store with
)

// A private PostgreSQL server for the PostgreSQL store tests (as tests/support/postgres.py
// starts for the Python ones): initdb and pg_ctl from Debian's postgresql package, a temp
// directory, a free loopback port, run as the postgres user when the tests run as root
// (PostgreSQL refuses root). With it, a broker redis-server of its own and a real worker
// whose store is the database (CHECKPOINTQ_STORE_URL=postgresql://...). Started on first
// use, so that runs without these tests do not pay for it, and stopped by TestMain. Never
// the machine's shared PostgreSQL on 5432.

type postgresServer struct {
	Port int
	bin  string
	dir  string
	data string
}

// postgresBin is the directory of the newest Debian PostgreSQL server programs.
func postgresBin() (string, error) {
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(found) == 0 {
		return "", fmt.Errorf("PostgreSQL's server programs are missing (apt-get install postgresql)")
	}
	sort.Slice(found, func(i, j int) bool { return pgMajor(found[i]) < pgMajor(found[j]) })
	return filepath.Dir(found[len(found)-1]), nil
}

func pgMajor(initdb string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(initdb))))
	return n
}

// asServerUser runs name as the user PostgreSQL runs as: root's tests hand it to postgres.
func asServerUser(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

func startPostgres() (*postgresServer, error) {
	bin, err := postgresBin()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "cq-go-pg-")
	if err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &postgresServer{Port: port, bin: bin, dir: dir, data: filepath.Join(dir, "data")}
	run := func(name string, args ...string) error {
		cmd := asServerUser(filepath.Join(bin, name), args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v\n%s", name, err, out)
		}
		return nil
	}
	if err := run("initdb", "-D", s.data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	// Small and quick; fsync off: these tests measure nothing and crash nothing.
	conf := fmt.Sprintf("listen_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = '%s'\n"+
		"max_connections = 50\nshared_buffers = 32MB\nfsync = off\nsynchronous_commit = off\n"+
		"full_page_writes = off\nlogging_collector = off\n", port, dir)
	f, err := os.OpenFile(filepath.Join(s.data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = run("pg_ctl", "-D", s.data, "-l", filepath.Join(dir, "server.log"), "-w", "-t", "60", "start")
	}
	if err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// URL is the store URL the worker takes, and the DSN lib/pq takes.
func (s *postgresServer) URL() string {
	return fmt.Sprintf("postgresql://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port)
}

func (s *postgresServer) Stop() {
	cmd := asServerUser(filepath.Join(s.bin, "pg_ctl"), "-D", s.data, "-m", "immediate", "-w", "stop")
	cmd.Dir = s.dir
	_ = cmd.Run()
	_ = os.RemoveAll(s.dir)
}

// pgDeployment is a worker between its own broker and a PostgreSQL store.
type pgDeployment struct {
	broker   *redisServer
	database *postgresServer
	worker   *worker
	db       *sql.DB
	schema   string
}

var (
	pgOnce sync.Once
	pgEnv  *pgDeployment
	pgErr  error
)

// pgDeploymentFor starts the shared PostgreSQL deployment on first use.
func pgDeploymentFor(t *testing.T) *pgDeployment {
	t.Helper()
	pgOnce.Do(func() { pgEnv, pgErr = startPGDeployment() })
	if pgErr != nil {
		t.Fatalf("PostgreSQL deployment: %v", pgErr)
	}
	return pgEnv
}

func startPGDeployment() (*pgDeployment, error) {
	d := &pgDeployment{schema: "cq_go"}
	var err error
	if d.broker, err = startRedis(); err != nil {
		return nil, err
	}
	if d.database, err = startPostgres(); err != nil {
		d.broker.Stop()
		return nil, err
	}
	if d.db, err = sql.Open("postgres", d.database.URL()); err == nil {
		d.worker, err = startWorkerWith(d.broker.URL(), d.database.URL(),
			[]string{"CHECKPOINTQ_PG_SCHEMA=" + d.schema})
	}
	if err == nil {
		// The worker makes the schema on its first use of the database: wait for it.
		err = pollUntil(30*time.Second, "the worker to create schema "+d.schema, func() bool {
			var found sql.NullString
			err := d.db.QueryRow("SELECT to_regclass($1)::text", d.schema+".sessions").Scan(&found)
			return err == nil && found.Valid
		})
		if err != nil {
			err = fmt.Errorf("%v:\n%s", err, d.worker.Log())
		}
	}
	if err != nil {
		d.stop()
		return nil, err
	}
	return d, nil
}

func (d *pgDeployment) stop() {
	if d.worker != nil {
		d.worker.Stop()
	}
	if d.db != nil {
		_ = d.db.Close()
	}
	d.database.Stop()
	d.broker.Stop()
}

func stopPGDeployment() {
	if pgEnv != nil {
		pgEnv.stop()
	}
}

// newPGClient is a client of the PostgreSQL deployment: the broker through redigo, the
// store through the deployment's *sql.DB (lib/pq).
func newPGClient[C any](t *testing.T, cfg Config) *Client[C] {
	t.Helper()
	d := pgDeploymentFor(t)
	if cfg.Broker == nil {
		broker := newRedigo(d.broker.Addr)
		t.Cleanup(func() { _ = broker.Close() })
		cfg.Broker = broker
	}
	cfg.Postgres, cfg.PostgresSchema = d.db, d.schema
	return New[C](cfg)
}

// storedPG reads id's checkpoint from the database itself, as the worker wrote it (nil:
// none live).
func storedPG(t *testing.T, c *Client[Checkpoint], id string) *Checkpoint {
	t.Helper()
	var value []byte
	err := c.cfg.Postgres.QueryRowContext(context.Background(),
		"SELECT value FROM "+c.cfg.PostgresSchema+".sessions WHERE session_key = "+c.cfg.PostgresSchema+".session_key($1) AND value IS NOT NULL "+
			"AND value_deadline_ms > "+c.cfg.PostgresSchema+".now_ms()", []byte(id)).Scan(&value)
	if err == sql.ErrNoRows {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return decodeStored(t, value)
}
