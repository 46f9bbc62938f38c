"""Encryption at rest: stored values sealed with AES-256-GCM under a key per session.

Opt-in (``CHECKPOINTQ_ENCRYPTION_KEYS``). A sealed value is the store's usual value (zstd
JSON) inside an envelope, so the byte budget, the staged values and the pending records all
carry it unchanged::

    b"CQE" 0x01 | key id length (1 byte) | key id (ASCII) | nonce (12 bytes) | ciphertext+tag

The AEAD key is derived per session, HKDF-SHA256(master key, info = label + session id),
and the associated data binds the session id and the key id: a value copied into another
session, or with one bit changed, fails to open (``CorruptCheckpoint``). The envelope's first
byte is neither zstd's magic nor JSON's, so a clear value (written before encryption was
turned on, or by a store without keys) is told apart and still loads.

The first key of the keyring encrypts; every key decrypts (rotation: docs/security.md).
Keys never appear in a repr, a log line or an error: only their ids do.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hmac import HMAC

from checkpointq.store.errors import CheckpointError, StoreUnavailable

#: The first bytes of every sealed value: format 1.
MAGIC = b"CQE\x01"
#: HKDF's info is this label followed by the session id's UTF-8 bytes.
HKDF_LABEL = b"checkpointq/v1 session key\x00"
#: The associated data: this label, the session id's UTF-8 bytes, a NUL, the key id.
AD_LABEL = b"checkpointq/v1 value\x00"
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_BYTES = 32
#: A key id: a short name, safe in logs and in the envelope.
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,32}")
#: Sessions whose AEAD (derived key) a keyring keeps, least recently used dropped first:
#: deriving a key and building its AEAD costs ~1.5 us hot, ~8 us between two saves (OpenSSL
#: cold), a hit ~0.2; bounded so that a process never holds more than this many session
#: keys, whatever the number of sessions it sees (docs/security.md, docs/performance.md).
CACHED_SESSION_KEYS = 1024


class EncryptionError(CheckpointError, ValueError):
    """A keyring setting that cannot be used; the message never holds a key."""


class MissingEncryptionKey(StoreUnavailable):
    """A sealed value names a key this process does not have (or it has no keys at all).

    Not the request's fault: a worker or producer with the key can read it, so the request
    waits (retried, never dead-lettered) and the error names the key id it lacks."""

    def __init__(self, key_id: str, session_id: str | None = None) -> None:
        self.key_id = key_id
        self.session_id = session_id
        where = f" (session {session_id!r})" if session_id is not None else ""
        super().__init__(
            f"a stored value is encrypted under key id {key_id!r}, which this process does "
            f"not have{where}: add it to CHECKPOINTQ_ENCRYPTION_KEYS"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (MissingEncryptionKey, (self.key_id, self.session_id))


class OpenFailed(ValueError):
    """A sealed value that does not open: tampered with, truncated, or another session's."""


def is_sealed(value: bytes) -> bool:
    """Whether ``value`` is in the encrypted envelope (rather than clear zstd or JSON)."""
    return value[:4] == MAGIC


def sealed_key_id(value: bytes) -> str | None:
    """The key id a sealed value names (None: not sealed, or a broken envelope)."""
    if not is_sealed(value) or len(value) < 5:
        return None
    size = value[4]
    raw = value[5 : 5 + size]
    if len(raw) != size:
        return None
    try:
        key_id = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return key_id if KEY_ID.fullmatch(key_id) else None


def generate_key() -> str:
    """A fresh master key: 32 random bytes, URL-safe base64 (what ``checkpointq keygen``
    prints)."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def _decode_key(key_id: str, text: str) -> bytes:
    padded = text.strip() + "=" * (-len(text.strip()) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise EncryptionError(f"key {key_id!r} is not URL-safe base64") from None
    if len(raw) != KEY_BYTES:
        raise EncryptionError(
            f"key {key_id!r} is {len(raw)} bytes; a key is {KEY_BYTES} random bytes "
            "(`checkpointq keygen` makes one)"
        )
    return raw


class Keyring:
    """Named master keys: the first encrypts, all decrypt. Safe to share between threads."""

    def __init__(self, keys: Iterable[tuple[str, bytes]]) -> None:
        self._keys: dict[str, bytes] = {}
        for key_id, key in keys:
            if not KEY_ID.fullmatch(key_id):
                raise EncryptionError(
                    f"key id {key_id[:40]!r} must be 1-32 letters, digits, '_', '-' or '.'"
                )
            if key_id in self._keys:
                raise EncryptionError(f"key id {key_id!r} is given twice")
            if len(key) != KEY_BYTES:
                raise EncryptionError(f"key {key_id!r} must be {KEY_BYTES} bytes")
            self._keys[key_id] = bytes(key)
        if not self._keys:
            raise EncryptionError("no keys given")
        #: The id of the key new values are sealed under.
        self.primary = next(iter(self._keys))
        # HKDF-Extract of each master key (no salt: HashLen zero bytes), once: a session's
        # key is then HKDF-Expand alone, one HMAC of a copied context (``derive_key``).
        self._expand: dict[str, HMAC] = {
            key_id: HMAC(_extract(key), hashes.SHA256()) for key_id, key in self._keys.items()
        }
        self._derived: OrderedDict[tuple[str, str], AESGCM] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """A keyring from ``id:key,id:key,...`` (whitespace and newlines between pairs are
        allowed, so a file may hold one pair per line).

        Raises:
            EncryptionError: malformed, naming the pair's id but never its key.
        """
        pairs: list[tuple[str, bytes]] = []
        for position, item in enumerate(re.split(r"[,\s]+", text.strip()), 1):
            if not item:
                continue
            key_id, sep, key = item.partition(":")
            if not sep or not key:
                raise EncryptionError(f"pair {position} is not of the form id:key")
            pairs.append((key_id, _decode_key(key_id, key)))
        return cls(pairs)

    @classmethod
    def from_file(cls, path: Path) -> Keyring:
        """A keyring from a file holding the same text as the variable.

        Raises:
            EncryptionError: unreadable or malformed.
        """
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise EncryptionError(f"cannot read the keys file {str(path)!r}: {exc}") from None
        return cls.parse(text)

    @property
    def key_ids(self) -> list[str]:
        """Every key id, the encrypting one first."""
        return list(self._keys)

    def __repr__(self) -> str:
        return f"Keyring(primary={self.primary!r}, ids={self.key_ids!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Handed to pool processes with the store's options: the keys, not the cache.
        return (Keyring, (list(self._keys.items()),))

    def derive_key(self, key_id: str, session_id: str) -> bytes:
        """``session_id``'s AEAD key under ``key_id``: HKDF-SHA256(master key, no salt,
        info = ``HKDF_LABEL`` + session id), RFC 5869. Its output is one SHA-256 block, so
        Expand is T(1) = HMAC(PRK, info | 0x01); the PRK's HMAC context is made once per key
        and copied: 0.7 us against 6 for a whole ``HKDF.derive`` (the bytes are the same:
        tests/store/test_encryption.py checks them against ``cryptography``'s HKDF)."""
        expand = self._expand[key_id].copy()
        expand.update(HKDF_LABEL + session_id.encode("utf-8", "surrogatepass") + b"\x01")
        return expand.finalize()

    def _aead(self, key_id: str, session_id: str) -> AESGCM:
        """The session's AEAD, from a bounded LRU cache (a keyring's keys never change, so
        an entry can never be stale: a new keyring starts with an empty cache)."""
        cache_key = (key_id, session_id)
        derived = self._derived
        # A hit takes no lock (each OrderedDict call is atomic under the GIL): it is the
        # path of every later turn of a session, and the lock cost it ~1 us, cold.
        aead = derived.get(cache_key)
        if aead is not None:
            # (another thread may have dropped it meanwhile: it still works)
            with contextlib.suppress(KeyError):
                derived.move_to_end(cache_key)
            return aead
        aead = AESGCM(self.derive_key(key_id, session_id))
        with self._lock:
            derived[cache_key] = aead
            while len(derived) > CACHED_SESSION_KEYS:
                derived.popitem(last=False)
        return aead

    @staticmethod
    def associated_data(session_id: str, key_id: str) -> bytes:
        return AD_LABEL + session_id.encode("utf-8", "surrogatepass") + b"\x00" + key_id.encode()

    def seal(self, session_id: str, plaintext: bytes, key_id: str | None = None) -> bytes:
        """``plaintext`` sealed for ``session_id`` under the primary key (or ``key_id``)."""
        key_id = key_id or self.primary
        nonce = os.urandom(NONCE_BYTES)
        ad = self.associated_data(session_id, key_id)
        body = self._aead(key_id, session_id).encrypt(nonce, plaintext, ad)
        kid = key_id.encode()
        return b"".join((MAGIC, bytes((len(kid),)), kid, nonce, body))

    def open(self, session_id: str, sealed: bytes) -> bytes:
        """The plaintext of a sealed value of ``session_id``.

        Raises:
            MissingEncryptionKey: sealed under a key this keyring lacks.
            OpenFailed: a broken envelope, tampered with, or sealed for another session.
        """
        key_id = sealed_key_id(sealed)
        if key_id is None:
            raise OpenFailed("not an encrypted value of a known format")
        if key_id not in self._keys:
            raise MissingEncryptionKey(key_id, session_id)
        start = 5 + len(key_id)
        nonce, body = sealed[start : start + NONCE_BYTES], sealed[start + NONCE_BYTES :]
        if len(body) < TAG_BYTES:
            raise OpenFailed("encrypted value is truncated")
        try:
            return self._aead(key_id, session_id).decrypt(
                nonce, body, self.associated_data(session_id, key_id)
            )
        except InvalidTag:
            raise OpenFailed(
                f"encrypted value (key id {key_id!r}) does not authenticate: it was altered, "
                "or it belongs to another session"
            ) from None


def _extract(master: bytes) -> bytes:
    """HKDF-Extract without a salt: HMAC-SHA256 keyed with HashLen zero bytes."""
    extract = HMAC(bytes(32), hashes.SHA256())
    extract.update(master)
    return extract.finalize()


def open_without_keys(session_id: str, sealed: bytes) -> MissingEncryptionKey:
    """The error a process without any keys meets on a sealed value."""
    return MissingEncryptionKey(sealed_key_id(sealed) or "?", session_id)


#: Bytes a sealed value adds to the value it seals, at most (32-character key id).
MAX_OVERHEAD = len(MAGIC) + 1 + 32 + NONCE_BYTES + TAG_BYTES
