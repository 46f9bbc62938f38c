"""Operations: heartbeats and health, metrics, the live view, and looking at the broker."""
