"""Operations: heartbeats and health, metrics, the live view, looking at the broker, the
Redis eviction check, and sessions as producers see them (``show``, ``ls``)."""
