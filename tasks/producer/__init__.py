"""The producer side: the client API servers call, its batching, and the fast publish path."""
