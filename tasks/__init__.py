"""Celery tasks that apply checkpoint requests to the store, and the producer client.

Nothing here imports ``worker``: the worker installs a ``Runtime`` (store, dead letters,
policy) through ``checkpointq.tasks.runtime`` after each fork, and the tasks read it from there.
"""
