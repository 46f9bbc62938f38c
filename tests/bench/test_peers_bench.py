"""The peers section runs without its benchmark-only extra: a missing peer is skipped, named."""

from __future__ import annotations

import pytest

from bench import peers_bench


def test_a_peer_whose_package_is_missing_is_skipped_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a peer whose module is not installed
    monkeypatch.setitem(peers_bench.NEEDS, peers_bench.AGENTS, ("no_such_peer_module.sub",))

    # When the section asks whether it can run it
    why = peers_bench.available(peers_bench.AGENTS)

    # Then it cannot, and says which module is missing and how to install it
    assert why is not None
    assert "no_such_peer_module.sub not installed" in why
    assert ".[bench-peers]" in why
    # and our own way never needs the extra
    assert peers_bench.available(peers_bench.OURS) is None
