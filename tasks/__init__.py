"""Celery tasks that apply checkpoint requests to the store, and the producer client.

Nothing here imports ``worker``: the worker installs a ``Runtime`` (store, dead letters,
policy) through ``tasks.runtime`` after each fork, and the tasks read it from there.
"""
