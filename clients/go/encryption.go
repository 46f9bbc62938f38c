package checkpointq

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// Encryption at rest, as the workers do it (store/encryption.py; docs/security.md): a
// sealed value is the usual zstd value in an envelope,
//
//	"CQE" 0x01 | key id length (1 byte) | key id | nonce (12 bytes) | AES-256-GCM ciphertext+tag
//
// under a key derived per session, HKDF-SHA256(master key, no salt, info = label + session
// id), with the session id and the key id as associated data. The same keys give the same
// bytes in Python and Go, so either reads what the other wrote.

var sealMagic = []byte("CQE\x01")

const (
	hkdfLabel   = "checkpointq/v1 session key\x00"
	adLabel     = "checkpointq/v1 value\x00"
	masterBytes = 32
	nonceBytes  = 12
)

var keyIDPattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,32}$`)

// Keyring holds named master keys (CHECKPOINTQ_ENCRYPTION_KEYS): the first seals every
// value a save writes, all of them open values a load reads. Its String shows ids only.
type Keyring struct {
	ids  []string
	keys map[string][]byte
}

// ParseKeyring reads "id:key,id:key,..." (pairs may also be separated by whitespace or new
// lines, as in CHECKPOINTQ_ENCRYPTION_KEYS_FILE), each key 32 random bytes in URL-safe
// base64 (`checkpointq keygen` prints one). Its errors name a pair's id, never its key.
func ParseKeyring(text string) (*Keyring, error) {
	k := &Keyring{keys: map[string][]byte{}}
	items := strings.FieldsFunc(text, func(r rune) bool {
		return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r'
	})
	for i, item := range items {
		id, key, ok := strings.Cut(item, ":")
		if !ok || key == "" {
			return nil, fmt.Errorf("checkpointq: encryption keys: pair %d is not of the form id:key", i+1)
		}
		if !keyIDPattern.MatchString(id) {
			return nil, fmt.Errorf("checkpointq: encryption keys: key id %q must be 1-32 letters, digits, '_', '-' or '.'", id)
		}
		if _, dup := k.keys[id]; dup {
			return nil, fmt.Errorf("checkpointq: encryption keys: key id %q is given twice", id)
		}
		raw, err := base64.URLEncoding.DecodeString(key + strings.Repeat("=", (4-len(key)%4)%4))
		if err != nil {
			return nil, fmt.Errorf("checkpointq: encryption keys: key %q is not URL-safe base64", id)
		}
		if len(raw) != masterBytes {
			return nil, fmt.Errorf("checkpointq: encryption keys: key %q is %d bytes; a key is %d random bytes", id, len(raw), masterBytes)
		}
		k.ids = append(k.ids, id)
		k.keys[id] = raw
	}
	if len(k.ids) == 0 {
		return nil, errors.New("checkpointq: encryption keys: no keys given")
	}
	return k, nil
}

// Primary is the id of the key new values are sealed under.
func (k *Keyring) Primary() string { return k.ids[0] }

// String names the keys by id, never showing one.
func (k *Keyring) String() string { return "Keyring(" + strings.Join(k.ids, ",") + ")" }

// hkdfSHA256 is RFC 5869 HKDF with SHA-256 and no salt (a zero salt of the hash's length).
func hkdfSHA256(secret, info []byte, length int) []byte {
	extract := hmac.New(sha256.New, make([]byte, sha256.Size))
	extract.Write(secret)
	prk := extract.Sum(nil)
	var out, block []byte
	for counter := byte(1); len(out) < length; counter++ {
		expand := hmac.New(sha256.New, prk)
		expand.Write(block)
		expand.Write(info)
		expand.Write([]byte{counter})
		block = expand.Sum(nil)
		out = append(out, block...)
	}
	return out[:length]
}

func (k *Keyring) aead(keyID, sessionID string) (cipher.AEAD, error) {
	key := hkdfSHA256(k.keys[keyID], []byte(hkdfLabel+sessionID), masterBytes)
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(block)
}

func associatedData(sessionID, keyID string) []byte {
	return []byte(adLabel + sessionID + "\x00" + keyID)
}

// seal returns value sealed for sessionID under the primary key.
func (k *Keyring) seal(sessionID string, value []byte) ([]byte, error) {
	id := k.Primary()
	gcm, err := k.aead(id, sessionID)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(sealMagic)+1+len(id)+nonceBytes+len(value)+gcm.Overhead())
	out = append(append(append(out, sealMagic...), byte(len(id))), id...)
	nonce := make([]byte, nonceBytes)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	out = append(out, nonce...)
	return gcm.Seal(out, nonce, value, associatedData(sessionID, id)), nil
}

// isSealed says whether a stored value is in the encrypted envelope.
func isSealed(stored []byte) bool {
	return len(stored) >= len(sealMagic) && string(stored[:len(sealMagic)]) == string(sealMagic)
}

// sealedKeyID is the key id a sealed value names ("" for a broken envelope).
func sealedKeyID(stored []byte) string {
	if !isSealed(stored) || len(stored) < 5 {
		return ""
	}
	n := int(stored[4])
	if len(stored) < 5+n || !keyIDPattern.Match(stored[5:5+n]) {
		return ""
	}
	return string(stored[5 : 5+n])
}

// unseal returns a stored value's zstd (or JSON) bytes: opened when it is sealed (an
// ErrMissingKey naming the key id when k lacks it, or is nil), else as it is.
func (k *Keyring) unseal(sessionID string, stored []byte) ([]byte, error) {
	if !isSealed(stored) {
		return stored, nil
	}
	id := sealedKeyID(stored)
	if id == "" {
		return nil, fmt.Errorf("%w: %q: not an encrypted value of a known format", ErrCorrupt, sessionID)
	}
	if k == nil || k.keys[id] == nil {
		return nil, fmt.Errorf("%w: a stored value is encrypted under key id %q, which this client does not have (session %q): add it to Config.Encryption", ErrMissingKey, id, sessionID)
	}
	gcm, err := k.aead(id, sessionID)
	if err != nil {
		return nil, err
	}
	rest := stored[5+len(id):]
	if len(rest) < nonceBytes+gcm.Overhead() {
		return nil, fmt.Errorf("%w: %q: encrypted value is truncated", ErrCorrupt, sessionID)
	}
	plain, err := gcm.Open(nil, rest[:nonceBytes], rest[nonceBytes:], associatedData(sessionID, id))
	if err != nil {
		return nil, fmt.Errorf("%w: %q: encrypted value (key id %q) does not authenticate: it was altered, or it belongs to another session", ErrCorrupt, sessionID, id)
	}
	return plain, nil
}
