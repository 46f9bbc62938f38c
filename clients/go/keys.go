package checkpointq

// Keys of the single-Redis layout (store/keys.py, KeySpace): the checkpoint where the Go
// RedisStore keeps it, and checkpointq's bookkeeping under "<prefix>.cq:". The Redis Cluster
// layout (ClusterKeySpace) is not supported by this client.
type keySpace struct {
	prefix string
}

// DefaultPrefix is the Go RedisStore's key prefix.
const DefaultPrefix = "agentorca-session"

func (k keySpace) data(sessionID string) string    { return k.prefix + ":" + sessionID }
func (k keySpace) internal() string                { return k.prefix + ".cq" }
func (k keySpace) fence(sessionID string) string   { return k.internal() + ":fence:" + sessionID }
func (k keySpace) index() string                   { return k.internal() + ":deadlines" }
func (k keySpace) refused(requestID string) string { return k.internal() + ":refused:" + requestID }
