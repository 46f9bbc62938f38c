package checkpointq

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/gomodule/redigo/redis"
)

const (
	testKeyNew = "new:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="
	testKeyOld = "old:ZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXp7fH1-f4CBgoM="
	secretText = "the-patient-asked-about-lisinopril"
)

func TestKeyringSealsPerSessionAndNeverShowsAKey(t *testing.T) {
	k, err := ParseKeyring(testKeyNew + "," + testKeyOld)
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := k.seal("s1", []byte("zstd bytes"))
	if err != nil {
		t.Fatal(err)
	}
	if !isSealed(sealed) || sealedKeyID(sealed) != "new" {
		t.Fatalf("not a sealed value under key new: %q", sealed[:8])
	}
	if plain, err := k.unseal("s1", sealed); err != nil || string(plain) != "zstd bytes" {
		t.Fatalf("unseal: %q, %v", plain, err)
	}
	if _, err := k.unseal("s2", sealed); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("moved to another session: %v, want ErrCorrupt", err)
	}
	var none *Keyring
	if _, err := none.unseal("s1", sealed); !errors.Is(err, ErrMissingKey) || !strings.Contains(err.Error(), `key id "new"`) {
		t.Fatalf("without keys: %v, want ErrMissingKey naming new", err)
	}
	if strings.Contains(k.String(), "AAEC") {
		t.Fatalf("String shows a key: %s", k)
	}
	for _, bad := range []string{"", "a", "a:short", "a b:" + strings.TrimPrefix(testKeyNew, "new:")} {
		if _, err := ParseKeyring(bad); err == nil {
			t.Fatalf("ParseKeyring(%q) accepted", bad)
		}
	}
}

// cli runs `checkpointq args...` of the .venv against broker and store with keys.
func cli(t *testing.T, brokerURL, storeURL, keys, stdin string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(os.Getenv("CHECKPOINTQ_BIN"), args...)
	cmd.Env = append(os.Environ(), "CHECKPOINTQ_BROKER_URL="+brokerURL, "CHECKPOINTQ_STORE_URL="+storeURL,
		"CHECKPOINTQ_ENCRYPTION_KEYS="+keys)
	cmd.Stdin = strings.NewReader(stdin)
	cmd.Dir = t.TempDir()
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			t.Fatalf("checkpointq %v: %v\n%s", args, err, exit.Stderr)
		}
		t.Fatal(err)
	}
	return out
}

// TestEncryptedValuesCrossBetweenGoAndPython: with the same keys, a save from Go is stored
// sealed and read by Python's `checkpointq show`, and a save from Python is read by Go.
func TestEncryptedValuesCrossBetweenGoAndPython(t *testing.T) {
	broker, store := privateRedis(t), privateRedis(t)
	keys := testKeyNew + "," + testKeyOld
	w, err := startWorkerWith(broker.URL(), store.URL(), []string{"CHECKPOINTQ_ENCRYPTION_KEYS=" + keys})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	ring, err := ParseKeyring(keys)
	if err != nil {
		t.Fatal(err)
	}
	b, s := newRedigo(broker.Addr), newRedigo(store.Addr)
	defer b.Close()
	defer s.Close()
	c := New[Checkpoint](Config{Broker: b, Store: s, Encryption: ring})
	ctx := background(t)

	// Go -> Python: a save from Go is applied, stored sealed under the first key
	sent := sampleCheckpoint("enc-from-go", 3, secretText+" 0", secretText+" 1")
	h, err := c.SaveAsync(ctx, sent)
	if err != nil {
		t.Fatal(err)
	}
	if h.Task != TaskSaveStaged {
		t.Fatalf("task %s, want %s", h.Task, TaskSaveStaged)
	}
	mustWait(t, c, h, Applied)
	stored, err := redis.Bytes(store.Do("GET", c.keys.data("enc-from-go")))
	if err != nil {
		t.Fatal(err)
	}
	if sealedKeyID(stored) != "new" || bytes.Contains(stored, []byte(secretText)) {
		t.Fatalf("stored value is not sealed under new: %q", stored[:8])
	}
	if got, err := c.Load(ctx, "enc-from-go"); err != nil || normalise(got) != normalise(sent) {
		t.Fatalf("Go load: %v, %v", got, err)
	}
	var shown Checkpoint
	out := cli(t, broker.URL(), store.URL(), keys, "", "show", "enc-from-go", "--json")
	if err := json.Unmarshal(out, &shown); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if normalise(&shown) != normalise(sent) {
		t.Fatalf("Python read %s, want %s", normalise(&shown), normalise(sent))
	}

	// Python -> Go: a save from Python, under the same keys, loads in Go
	doc := `{"sessionId":"enc-from-py","version":7,"conversationHistory":[{"role":"user","content":"` +
		secretText + `"}],"metadata":{}}`
	cli(t, broker.URL(), store.URL(), keys, doc, "save", "-", "--wait")
	got, err := c.Load(ctx, "enc-from-py")
	if err != nil || got == nil || got.Version != 7 || got.ConversationHistory[0].Content != secretText {
		t.Fatalf("Go load of Python's save: %+v, %v", got, err)
	}
	// And a Go client without the keys fails, naming the key id, rather than misread it
	plain := New[Checkpoint](Config{Broker: b, Store: s})
	if _, err := plain.Load(ctx, "enc-from-py"); !errors.Is(err, ErrMissingKey) || !strings.Contains(err.Error(), `"new"`) {
		t.Fatalf("load without keys: %v, want ErrMissingKey naming new", err)
	}
	// Nothing of the conversation is on the broker either
	for _, server := range []*redisServer{broker, store} {
		keys, err := redis.Strings(server.Do("KEYS", "*"))
		if err != nil {
			t.Fatal(err)
		}
		for _, key := range keys {
			if v, err := redis.Bytes(server.Do("GET", key)); err == nil && bytes.Contains(v, []byte(secretText)) {
				t.Fatalf("%s holds the conversation in clear", key)
			}
		}
	}
}
