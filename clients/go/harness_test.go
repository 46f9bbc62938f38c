package checkpointq

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// The integration tests run against real processes started here, never against anything
// shared: two private redis-servers (broker and store) on free loopback ports, and one
// real `checkpointq worker` (CHECKPOINTQ_BIN, set by scripts/test-go) for the package.

// redisServer is a private redis-server on a free loopback port.
type redisServer struct {
	Addr string
	cmd  *exec.Cmd
	dir  string
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startRedis(extraArgs ...string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not on PATH (scripts/test-go installs it): %w", err)
	}
	dir, err := os.MkdirTemp("", "cq-go-redis-")
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &redisServer{Addr: fmt.Sprintf("127.0.0.1:%d", port), dir: dir}
	args := append([]string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir, "--logfile", filepath.Join(dir, "redis.log")},
		extraArgs...)
	s.cmd = exec.Command(bin, args...)
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	err = pollUntil(10*time.Second, "redis-server to answer on "+s.Addr, func() bool {
		conn, err := redis.Dial("tcp", s.Addr, redis.DialConnectTimeout(time.Second))
		if err != nil {
			return false
		}
		defer conn.Close()
		_, err = conn.Do("PING")
		return err == nil
	})
	if err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// privateRedis is a redis-server for the calling test alone, stopped once it ended.
func privateRedis(t *testing.T) *redisServer {
	t.Helper()
	s, err := startRedis()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

func (s *redisServer) URL() string { return "redis://" + s.Addr + "/0" }

// Do runs one command on the server (test set-up and inspection).
func (s *redisServer) Do(cmd string, args ...interface{}) (interface{}, error) {
	conn, err := redis.Dial("tcp", s.Addr, redis.DialConnectTimeout(5*time.Second),
		redis.DialReadTimeout(5*time.Second))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return conn.Do(cmd, args...)
}

func (s *redisServer) Stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	}
	_ = os.RemoveAll(s.dir)
}

// worker is a real `checkpointq worker` process with its log in a file.
type worker struct {
	cmd *exec.Cmd
	log string
	dir string
}

func startWorker(brokerURL, storeURL string) (*worker, error) {
	return startWorkerWith(brokerURL, storeURL, nil)
}

// startWorkerWith starts `checkpointq worker args...` with extraEnv added to its settings.
func startWorkerWith(brokerURL, storeURL string, extraEnv []string, args ...string) (*worker, error) {
	bin := os.Getenv("CHECKPOINTQ_BIN")
	if bin == "" {
		return nil, fmt.Errorf("CHECKPOINTQ_BIN is not set: run the Go tests with scripts/test-go, which sets it to .venv/bin/checkpointq")
	}
	dir, err := os.MkdirTemp("", "cq-go-worker-")
	if err != nil {
		return nil, err
	}
	w := &worker{log: filepath.Join(dir, "worker.log"), dir: dir}
	out, err := os.Create(w.log)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CHECKPOINTQ_") {
			env = append(env, kv)
		}
	}
	env = append(env,
		"CHECKPOINTQ_BROKER_URL="+brokerURL,
		"CHECKPOINTQ_STORE_URL="+storeURL,
		"CHECKPOINTQ_QUEUE=checkpoints",
		"CHECKPOINTQ_POOL=prefork",
		"CHECKPOINTQ_CONCURRENCY=2",
		"CHECKPOINTQ_RETRY_BACKOFF_SECONDS=0.1",
		"CHECKPOINTQ_RETRY_BACKOFF_MAX_SECONDS=0.5",
		"CHECKPOINTQ_SHUTDOWN_TIMEOUT_SECONDS=2",
		"CHECKPOINTQ_LOG_LEVEL=INFO",
	)
	env = append(env, extraEnv...)
	w.cmd = exec.Command(bin, append([]string{"worker"}, args...)...)
	w.cmd.Dir, w.cmd.Env, w.cmd.Stdout, w.cmd.Stderr = dir, env, out, out
	if err := w.cmd.Start(); err != nil {
		return nil, err
	}
	exited := make(chan struct{})
	go func() { _ = w.cmd.Wait(); close(exited) }()
	err = pollUntil(60*time.Second, "the checkpointq worker to be ready", func() bool {
		select {
		case <-exited:
			return true
		default:
		}
		return bytes.Contains(w.Log(), []byte("ready."))
	})
	select {
	case <-exited:
		return nil, fmt.Errorf("checkpointq worker exited at start:\n%s", w.Log())
	default:
	}
	if err != nil {
		w.Stop()
		return nil, fmt.Errorf("%v:\n%s", err, w.Log())
	}
	return w, nil
}

func (w *worker) Log() []byte {
	data, _ := os.ReadFile(w.log)
	return data
}

// Stop asks for a warm shutdown, then kills the worker if it has not exited in 20 s.
func (w *worker) Stop() {
	if w.cmd.Process == nil {
		return
	}
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	_ = pollUntil(20*time.Second, "the worker to exit", func() bool {
		return w.cmd.Process.Signal(syscall.Signal(0)) != nil
	})
	_ = w.cmd.Process.Kill()
	_ = os.RemoveAll(w.dir)
}

// pollUntil polls cond every few milliseconds until it holds or timeout passes.
func pollUntil(timeout time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	delay := 5 * time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(delay)
		if delay < 100*time.Millisecond {
			delay *= 2
		}
	}
	return nil
}

// deployment is shared by the package's integration tests: starting a worker costs seconds.
type deployment struct {
	broker, store *redisServer
	worker        *worker
}

var env *deployment

// silentListener accepts connections and never answers: a broker that hangs.
func silentListener(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		<-done
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return l.Addr().String()
}

// closedAddr is a loopback address nothing listens on: a broker that is down.
func closedAddr(t *testing.T) string {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	broker, err := startRedis()
	if err != nil {
		fmt.Fprintln(os.Stderr, "broker:", err)
		return 1
	}
	defer broker.Stop()
	store, err := startRedis()
	if err != nil {
		fmt.Fprintln(os.Stderr, "store:", err)
		return 1
	}
	defer store.Stop()
	w, err := startWorker(broker.URL(), store.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	env = &deployment{broker: broker, store: store, worker: w}
	defer stopClusterDeployment()
	defer stopPGDeployment()
	code := m.Run()
	if code != 0 {
		fmt.Fprintf(os.Stderr, "--- worker log ---\n%s\n", w.Log())
		if clusterEnv != nil {
			fmt.Fprintf(os.Stderr, "--- cluster worker log ---\n%s\n", clusterEnv.worker.Log())
		}
		if pgEnv != nil {
			fmt.Fprintf(os.Stderr, "--- PostgreSQL worker log ---\n%s\n", pgEnv.worker.Log())
		}
	}
	w.Stop()
	return code
}

// newClient is a client of the shared deployment for checkpoint type C.
func newClient[C any](t *testing.T, cfg Config) *Client[C] {
	t.Helper()
	broker, store := newRedigo(env.broker.Addr), newRedigo(env.store.Addr)
	t.Cleanup(func() { _ = broker.Close(); _ = store.Close() })
	if cfg.Broker == nil {
		cfg.Broker = broker
	}
	if cfg.Store == nil {
		cfg.Store = store
	}
	return New[C](cfg)
}

// sessionID is unique per test, so that tests sharing the deployment keep apart.
func sessionID(t *testing.T, suffix string) string {
	return strings.ReplaceAll(t.Name(), "/", "-") + "-" + suffix
}

func background(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}
