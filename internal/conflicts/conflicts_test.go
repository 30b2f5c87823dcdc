package conflicts

import (
	"strings"
	"testing"
)

// TestKey: queue and task ID pairs never share a key, and the key is under the
// prefix.
func TestKey(t *testing.T) {
	c := New(nil, "app:")
	type pair struct{ queue, id string }
	seen := map[string]pair{}
	for _, p := range []pair{
		{"a:b", "c"}, {"a", "b:c"}, {"a%3Ab", "c"}, {"a", "b%3Ac"},
		{"default", "x"}, {"", "default:x"}, {"default:", "x"},
	} {
		k := c.Key(p.queue, p.id)
		if prev, ok := seen[k]; ok {
			t.Errorf("Key(%q, %q) = Key(%q, %q) = %q", p.queue, p.id, prev.queue, prev.id, k)
		}
		seen[k] = p
		if !strings.HasPrefix(k, "app:reschedule:") {
			t.Errorf("Key(%q, %q) = %q, want it under app:reschedule:", p.queue, p.id, k)
		}
	}
	if got, want := c.Key("default", "6f1"), "app:reschedule:default:6f1"; got != want {
		t.Errorf("Key(default, 6f1) = %q, want %q", got, want)
	}
}
