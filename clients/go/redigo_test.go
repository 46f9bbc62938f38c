package checkpointq

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"github.com/gomodule/redigo/redis"
)

// redigoRedis adapts a redigo pool to the client's Redis interface: the adapter the tests
// use (README.md has the go-redis/v9 one). Every command is bounded by ctx's deadline.
type redigoRedis struct {
	pool *redis.Pool
	// asking: send ASKING before each command, on the same connection (a cluster node
	// importing a slot serves its keys only then; see redigoCluster.route).
	asking bool
}

// asker is r sending ASKING before each command.
func (r *redigoRedis) asker() *redigoRedis { return &redigoRedis{pool: r.pool, asking: true} }

func newRedigo(addr string) *redigoRedis {
	return &redigoRedis{pool: &redis.Pool{
		MaxIdle:     16,
		IdleTimeout: time.Minute,
		DialContext: func(ctx context.Context) (redis.Conn, error) {
			return redis.DialContext(ctx, "tcp", addr,
				redis.DialConnectTimeout(5*time.Second),
				redis.DialReadTimeout(5*time.Second),
				redis.DialWriteTimeout(5*time.Second))
		},
	}}
}

func (r *redigoRedis) do(ctx context.Context, cmd string, args ...interface{}) (interface{}, error) {
	conn, err := r.pool.GetContext(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var timeout time.Duration // 0: the dial's read timeout
	if deadline, ok := ctx.Deadline(); ok {
		if timeout = time.Until(deadline); timeout <= 0 {
			return nil, context.DeadlineExceeded
		}
	}
	if r.asking {
		// Pipelined: Do flushes it with cmd and returns cmd's reply (or ASKING's error).
		if err := conn.Send("ASKING"); err != nil {
			return nil, err
		}
	}
	return redis.DoWithTimeout(conn, timeout, cmd, args...)
}

func (r *redigoRedis) Eval(ctx context.Context, script string, keys []string, args ...interface{}) (interface{}, error) {
	params := evalParams(script, keys, args)
	reply, err := r.do(ctx, "EVALSHA", params...)
	if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
		params[0] = script
		reply, err = r.do(ctx, "EVAL", params...)
	}
	return reply, err
}

func (r *redigoRedis) ZScan(ctx context.Context, key string, cursor uint64, count int64) ([]string, uint64, error) {
	reply, err := redis.Values(r.do(ctx, "ZSCAN", key, cursor, "COUNT", count))
	if err != nil {
		return nil, 0, err
	}
	next, err := redis.Uint64(reply[0], nil)
	if err != nil {
		return nil, 0, err
	}
	pairs, err := redis.Strings(reply[1], nil)
	return pairs, next, err
}

func (r *redigoRedis) Close() error { return r.pool.Close() }

// EvalWait is Eval followed by WAIT on the same connection, in one write (ReplicaWaiter).
func (r *redigoRedis) EvalWait(ctx context.Context, replicas int, timeout time.Duration, script string,
	keys []string, args ...interface{}) (interface{}, int64, error) {
	params := evalParams(script, keys, args)
	conn, err := r.pool.GetContext(ctx)
	if err != nil {
		return nil, 0, err
	}
	defer conn.Close()
	read := timeout + 5*time.Second
	if deadline, ok := ctx.Deadline(); ok {
		if read = time.Until(deadline); read <= 0 {
			return nil, 0, context.DeadlineExceeded
		}
	}
	for _, cmd := range []string{"EVALSHA", "EVAL"} {
		if cmd == "EVAL" {
			params[0] = script
		}
		if err := conn.Send(cmd, params...); err != nil {
			return nil, 0, err
		}
		if err := conn.Send("WAIT", replicas, timeout.Milliseconds()); err != nil {
			return nil, 0, err
		}
		if err := conn.Flush(); err != nil {
			return nil, 0, err
		}
		reply, evalErr := redis.ReceiveWithTimeout(conn, read)
		acked, err := redis.Int64(redis.ReceiveWithTimeout(conn, read))
		if evalErr != nil && strings.HasPrefix(evalErr.Error(), "NOSCRIPT") {
			continue
		}
		if evalErr != nil {
			return nil, 0, evalErr
		}
		return reply, acked, err
	}
	return nil, 0, fmt.Errorf("NOSCRIPT the broker refused the script by its text")
}

// evalParams is EVALSHA's arguments: the script's digest, the keys, the args.
func evalParams(script string, keys []string, args []interface{}) []interface{} {
	sum := sha1.Sum([]byte(script))
	params := make([]interface{}, 0, 2+len(keys)+len(args))
	params = append(params, hex.EncodeToString(sum[:]), len(keys))
	for _, k := range keys {
		params = append(params, k)
	}
	return append(params, args...)
}
