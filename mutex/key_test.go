package mutex

import (
	"strings"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
)

// Every key of one lock hashes by the same tag, so one Cluster slot.
func FuzzLockKeysShareSlot(f *testing.F) {
	f.Add("a")
	f.Add("a{b")
	f.Add(strings.Repeat("x", 300))
	f.Fuzz(func(t *testing.T, a string) {
		if a == "" {
			return
		}
		c := &Client{prefix: DefaultPrefix}
		rkey := c.redisKey(a)
		want := rediskey.Encode(a)
		for _, k := range []string{rkey, rkey + waitSuffix, rkey + slotsSuffix, releasedKey(rkey, "id")} {
			if tag := hashTag(k); tag != want {
				t.Fatalf("hash tag of %q = %q, want %q", k, tag, want)
			}
		}
	})
}

// hashTag is the part of a key Redis Cluster hashes: the text between the first '{'
// and the next '}' when that is not empty, else the whole key.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}
