package checkpointq

import (
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// A private Redis Cluster for the cluster tests (as tests/support/cluster.py starts for
// the Python ones): three masters on free loopback ports joined by `redis-cli --cluster
// create`, a broker redis-server of its own, and a real worker whose store is the cluster
// (a redis+cluster:// URL). Started on first use, so that runs without cluster tests do
// not pay for it, and stopped by TestMain.

type localCluster struct {
	nodes []*redisServer
}

func startCluster(masters int) (*localCluster, error) {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, fmt.Errorf("redis-cli not on PATH (scripts/test-go installs it): %w", err)
	}
	c := &localCluster{}
	for i := 0; i < masters; i++ {
		bus, err := freePort()
		if err != nil {
			c.Stop()
			return nil, err
		}
		// The bus port defaults to port + 10000, which may not be free: pick one.
		node, err := startRedis("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-port", fmt.Sprint(bus), "--cluster-node-timeout", "5000")
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.nodes = append(c.nodes, node)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		c.Stop()
		return nil, fmt.Errorf("redis-cli --cluster create: %v\n%s", err, out)
	}
	if err := pollUntil(60*time.Second, "every node to say cluster_state:ok", c.healthy); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

func (c *localCluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.Addr
	}
	return addrs
}

// URL is the store URL the worker takes (store/urls.py): every node as a seed.
func (c *localCluster) URL() string {
	return "redis+cluster://" + strings.Join(c.Addrs(), ",") + "/0"
}

func (c *localCluster) healthy() bool {
	for _, n := range c.nodes {
		info, err := redis.String(n.Do("CLUSTER", "INFO"))
		if err != nil || !strings.Contains(info, "cluster_state:ok") ||
			!strings.Contains(info, "cluster_slots_ok:16384") ||
			!strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d", len(c.nodes))) {
			return false
		}
	}
	return true
}

func (c *localCluster) Stop() {
	for _, n := range c.nodes {
		n.Stop()
	}
}

// clusterDeployment is a worker between its own broker and a cluster store.
type clusterDeployment struct {
	broker  *redisServer
	cluster *localCluster
	worker  *worker
}

var (
	clusterOnce sync.Once
	clusterEnv  *clusterDeployment
	clusterErr  error
)

// clusterDeploymentFor starts the shared cluster deployment on first use.
func clusterDeploymentFor(t *testing.T) *clusterDeployment {
	t.Helper()
	clusterOnce.Do(func() {
		d := &clusterDeployment{}
		if d.broker, clusterErr = startRedis(); clusterErr != nil {
			return
		}
		if d.cluster, clusterErr = startCluster(3); clusterErr != nil {
			d.broker.Stop()
			return
		}
		if d.worker, clusterErr = startWorker(d.broker.URL(), d.cluster.URL()); clusterErr != nil {
			d.cluster.Stop()
			d.broker.Stop()
			return
		}
		clusterEnv = d
	})
	if clusterErr != nil {
		t.Fatalf("cluster deployment: %v", clusterErr)
	}
	return clusterEnv
}

func stopClusterDeployment() {
	if clusterEnv != nil {
		clusterEnv.worker.Stop()
		clusterEnv.cluster.Stop()
		clusterEnv.broker.Stop()
	}
}

// newClusterClient is a client of the cluster deployment: Cluster set, and the store read
// through the cluster-routing adapter (returned too, for inspection).
func newClusterClient[C any](t *testing.T, cfg Config) (*Client[C], *redigoCluster) {
	t.Helper()
	d := clusterDeploymentFor(t)
	broker, store := newRedigo(d.broker.Addr), newRedigoCluster(d.cluster.Addrs())
	t.Cleanup(func() { _ = broker.Close(); _ = store.Close() })
	cfg.Cluster = true
	if cfg.Broker == nil {
		cfg.Broker = broker
	}
	if cfg.Store == nil {
		cfg.Store = store
	}
	return New[C](cfg), store
}
