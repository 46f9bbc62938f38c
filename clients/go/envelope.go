package checkpointq

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
)

// Task names: the message contract (docs/protocol.md).
const (
	TaskSave   = "checkpoint.save"
	TaskDelete = "checkpoint.delete"
	// TaskSaveStaged is an encrypted save (Config.Encryption): the message names the
	// session, and the workers read its sealed value from the broker.
	TaskSaveStaged = "checkpoint.save_staged"
)

// embed is the third part of a protocol 2 body, as Celery's send_task writes it.
const embed = `{"callbacks":null,"errbacks":null,"chain":null,"chord":null}`

// newUUID returns a random (version 4) UUID from crypto/rand.
func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("checkpointq: no randomness for a request id: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// withFreshTag returns msg with a fresh delivery tag, to publish it again: settle.lua tells
// the republished message from a delivery of the one before by its tag (a worker that held
// that one when the broker lost it settles nothing of the newer; finding 5 of
// tests/model/README.md), and kombu's unacked entries are keyed by it. A message that does
// not end with a tag goes as it is (pending.py's with_fresh_tag).
func withFreshTag(msg []byte) ([]byte, error) {
	key := []byte(`"delivery_tag":"`)
	from := len(msg) - 96
	if from < 0 {
		from = 0
	}
	at := bytes.LastIndex(msg[from:], key)
	if at < 0 || !bytes.HasSuffix(msg, []byte(`"}}`)) {
		return msg, nil
	}
	tag, err := newUUID()
	if err != nil {
		return nil, err
	}
	at += from + len(key)
	out := make([]byte, 0, at+len(tag)+3)
	return append(append(append(out, msg[:at]...), tag...), `"}}`...), nil
}

// origin names the producing process, as Celery's does ("gen<pid>@<host>").
func origin() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	return fmt.Sprintf("gen%d@%s", os.Getpid(), host)
}

// protocolBody is [args, kwargs, embed] from already-encoded JSON parts.
func protocolBody(argsJSON []byte, seq int64) []byte {
	body := make([]byte, 0, len(argsJSON)+len(embed)+40)
	body = append(body, '[')
	body = append(body, argsJSON...)
	body = append(body, `,{"seq":`...)
	body = append(body, fmt.Sprint(seq)...)
	body = append(body, '}', ',')
	body = append(body, embed...)
	body = append(body, ']')
	return body
}

// buildEnvelope renders one protocol 2 message for task with the given body: the message
// as Celery's (kombu's) Redis transport stores it, what one LPUSH onto the queue carries.
// Keys and values follow tasks/producer/fast_publish.py, which writes exactly what send_task
// writes. It is assembled from bytes rather than marshalled: encoding/json would scan the
// whole base64 body for characters to escape, and base64 has none. extraHeaders are more
// header members, each starting with a comma (traceHeaderFields).
func buildEnvelope(task, taskID, queue, replyTo, origin, argsRepr, kwargsRepr string, extraHeaders, body []byte) ([]byte, error) {
	tag, err := newUUID()
	if err != nil {
		return nil, err
	}
	n := base64.StdEncoding.EncodedLen(len(body))
	buf := make([]byte, 0, n+1024+len(argsRepr)+len(extraHeaders))
	buf = append(buf, `{"body":"`...)
	buf = buf[:len(buf)+n]
	base64.StdEncoding.Encode(buf[len(buf)-n:], body)
	for _, part := range [][]byte{
		[]byte(`","content-encoding":"utf-8","content-type":"application/json","headers":{"lang":"go","task":`),
		jsonString(task),
		[]byte(`,"id":`), jsonString(taskID),
		[]byte(`,"shadow":null,"eta":null,"expires":null,"group":null,"group_index":null,` +
			`"retries":0,"timelimit":[null,null],"root_id":`), jsonString(taskID),
		[]byte(`,"parent_id":null,"argsrepr":`), jsonString(argsRepr),
		[]byte(`,"kwargsrepr":`), jsonString(kwargsRepr),
		[]byte(`,"origin":`), jsonString(origin),
		[]byte(`,"ignore_result":null,"replaced_task_nesting":0,"stamped_headers":null,"stamps":{}`),
		extraHeaders,
		[]byte(`},"properties":{"correlation_id":`), jsonString(taskID),
		[]byte(`,"reply_to":`), jsonString(replyTo),
		[]byte(`,"delivery_mode":2,"delivery_info":{"exchange":"","routing_key":`), jsonString(queue),
		[]byte(`},"priority":0,"body_encoding":"base64","delivery_tag":`), jsonString(tag),
		[]byte(`}}`),
	} {
		buf = append(buf, part...)
	}
	return buf, nil
}

func jsonString(s string) []byte {
	b, _ := json.Marshal(s) // a string always marshals
	return b
}
