package checkpointq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/gomodule/redigo/redis"
)

// redigoCluster is a minimal cluster-routing adapter over redigo, for the tests: it reads
// CLUSTER SLOTS once, sends each command to the node serving its first key's slot, and
// follows MOVED (noting the slot's new node) and ASK (ASKING, then the command, on the
// node importing the slot; the map stays). A go-redis ClusterClient does all this, and
// more (README.md).
type redigoCluster struct {
	seeds []string
	mu    sync.Mutex
	slots []string // node address per slot; nil until CLUSTER SLOTS was read
	nodes map[string]*redigoRedis
}

func newRedigoCluster(seeds []string) *redigoCluster {
	return &redigoCluster{seeds: seeds, nodes: map[string]*redigoRedis{}}
}

func (c *redigoCluster) node(addr string) *redigoRedis {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, ok := c.nodes[addr]
	if !ok {
		n = newRedigo(addr)
		c.nodes[addr] = n
	}
	return n
}

// loadSlots reads CLUSTER SLOTS from the first seed that answers.
func (c *redigoCluster) loadSlots(ctx context.Context) error {
	var last error
	for _, seed := range c.seeds {
		ranges, err := redis.Values(c.node(seed).do(ctx, "CLUSTER", "SLOTS"))
		if err != nil {
			last = err
			continue
		}
		slots := make([]string, clusterSlots)
		for _, r := range ranges {
			fields, err := redis.Values(r, nil)
			if err != nil || len(fields) < 3 {
				return fmt.Errorf("CLUSTER SLOTS entry %v: %v", r, err)
			}
			lo, _ := redis.Int(fields[0], nil)
			hi, _ := redis.Int(fields[1], nil)
			master, err := redis.Values(fields[2], nil)
			if err != nil || len(master) < 2 {
				return fmt.Errorf("CLUSTER SLOTS master %v: %v", fields[2], err)
			}
			host, _ := redis.String(master[0], nil)
			port, _ := redis.Int(master[1], nil)
			for s := lo; s <= hi; s++ {
				slots[s] = host + ":" + strconv.Itoa(port)
			}
		}
		c.mu.Lock()
		c.slots = slots
		c.mu.Unlock()
		return nil
	}
	return fmt.Errorf("no seed answered CLUSTER SLOTS: %w", last)
}

// route runs call on the node serving key's slot, following up to 5 redirections: MOVED
// (the slot has moved: note its node) and ASK (the slot is moving and the key is not on
// its old node any more: this one call goes to the new node, after ASKING).
func (c *redigoCluster) route(ctx context.Context, key string, call func(*redigoRedis) (interface{}, error)) (interface{}, error) {
	c.mu.Lock()
	loaded := c.slots != nil
	c.mu.Unlock()
	if !loaded {
		if err := c.loadSlots(ctx); err != nil {
			return nil, err
		}
	}
	slot := keySlot(key)
	c.mu.Lock()
	addr := c.slots[slot]
	c.mu.Unlock()
	n := c.node(addr)
	for redirects := 0; ; redirects++ {
		reply, err := call(n)
		kind, target := redirection(err)
		if kind == "" || redirects == 5 {
			return reply, err
		}
		n = c.node(target)
		if kind == "ASK" {
			n = n.asker()
			continue
		}
		c.mu.Lock()
		c.slots[slot] = target
		c.mu.Unlock()
	}
}

// redirection reads a "MOVED <slot> <host:port>" or "ASK <slot> <host:port>" error: its
// kind ("" for any other error) and target.
func redirection(err error) (kind, target string) {
	if err == nil {
		return "", ""
	}
	fields := strings.Fields(err.Error())
	if len(fields) != 3 || (fields[0] != "MOVED" && fields[0] != "ASK") {
		return "", ""
	}
	return fields[0], fields[2]
}

func (c *redigoCluster) Eval(ctx context.Context, script string, keys []string, args ...interface{}) (interface{}, error) {
	if len(keys) == 0 {
		return nil, fmt.Errorf("redigoCluster routes by key: Eval needs one")
	}
	return c.route(ctx, keys[0], func(n *redigoRedis) (interface{}, error) { return n.Eval(ctx, script, keys, args...) })
}

func (c *redigoCluster) ZScan(ctx context.Context, key string, cursor uint64, count int64) ([]string, uint64, error) {
	var pairs []string
	var next uint64
	_, err := c.route(ctx, key, func(n *redigoRedis) (interface{}, error) {
		var err error
		pairs, next, err = n.ZScan(ctx, key, cursor, count)
		return nil, err
	})
	return pairs, next, err
}

// Do runs one command routed by its first argument, a key (test set-up and inspection).
func (c *redigoCluster) Do(ctx context.Context, cmd, key string, args ...interface{}) (interface{}, error) {
	return c.route(ctx, key, func(n *redigoRedis) (interface{}, error) {
		return n.do(ctx, cmd, append([]interface{}{key}, args...)...)
	})
}

func (c *redigoCluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.nodes {
		_ = n.Close()
	}
	return nil
}
