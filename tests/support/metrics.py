"""Reading a worker's Prometheus endpoint in tests."""

from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:<port>/metrics``, keyed by name and labels."""
    # http.client rather than urlopen: the connection is closed here, whatever happens,
    # instead of whenever the garbage collector gets to a response object.
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a counter nobody has touched yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
