package mutex

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// TestLayoutRoundTrip writes each stored format in one language and reads it in the
// other: a lock value and a tombstone written by common.lua are read by parseValue,
// a queue entry built by entryHead by common.lua's entry, and a wake-up message by
// parseWake, and the mark of a release is named alike, so that layout.go and the Lua
// that mirrors it cannot drift apart.
func TestLayoutRoundTrip(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		desc := describe("host-1\t42\t", "pay", "t\u00e91")
		id := identity("tok-en")
		prev := identity("prev-token")
		head := entryHead("client", "w7", 250*time.Millisecond, 5)
		probe := store.NewScript("layout_probe", luaLayout+"\n"+lua("common")+`
local v = value(tonumber(ARGV[1]), HELD, tonumber(ARGV[2]), ARGV[3] .. ARGV[4], ARGV[5])
local client, waiter, lease, who = entry(ARGV[6])
local h, p = holder(v)
return {v, withState(v, WAITED), tombstone(v, ARGV[3], ARGV[5]), client, waiter, lease, who, h, p,
  tostring(ours(v, ARGV[3])), tostring(held(tombstone(v, ARGV[3], ''))), tostring(fenceOf(v)),
  'lock' .. RELEASED_INFIX .. redis.sha1hex(ARGV[3])}`)
		res, err := store.New(b.rdb).Run(ctx, probe, nil,
			1234567, 1700000000123456, id, desc, prev, head+" "+id+desc).StringSlice()
		require.NoError(t, err)
		require.Len(t, res, 13)

		lv, ok := parseValue(res[0])
		require.True(t, ok, "Lua's value parses in Go: %q", res[0])
		assert.Equal(t, lockValue{fence: 1234567, state: stateHeld, since: 1700000000123456, id: id,
			holder: Holder{Host: "host-1", PID: 42, Name: "pay", ID: "t\u00e91"}, prev: prev}, lv)
		w, ok := parseValue(res[1])
		require.True(t, ok)
		assert.Equal(t, byte(stateWaited), w.state)
		ts, ok := parseValue(res[2])
		require.True(t, ok)
		assert.Equal(t, byte(stateReleased), ts.state)
		assert.Equal(t, id, ts.id, "a tombstone names the releaser")
		assert.Equal(t, Holder{}, ts.holder, "and describes nobody")

		assert.Equal(t, []string{"client", "w7", "250/5", id + desc}, res[3:7], "Go's entry read by Lua")
		assert.Equal(t, Holder{Host: "host-1", PID: 42, Name: "pay", ID: "t\u00e91"}, readEntry(head+" "+id+desc).Holder)
		assert.Equal(t, []string{id, prev}, res[7:9], "holder() finds the identity and the previous holder")
		assert.Equal(t, []string{"true", "false", "1234567"}, res[9:12])
		assert.Equal(t, releasedKey("lock", id), res[12], "the mark of a release, named alike by Go and by markReleased")
	})
}

func TestParseWake(t *testing.T) {
	for _, tc := range []struct {
		in     string
		waiter string
		fence  int64
		ok     bool
	}{
		{"w1 1700000000123456", "w1", 1700000000123456, true},
		{"w1 " + wakeRetry, "w1", 0, true},
		{"w1 0", "", 0, false},
		{"w1", "", 0, false},
		{"w1 x", "", 0, false},
	} {
		waiter, fence, ok := parseWake(tc.in)
		if ok != tc.ok || (ok && (waiter != tc.waiter || fence != tc.fence)) {
			t.Errorf("parseWake(%q) = %q, %d, %v; want %q, %d, %v", tc.in, waiter, fence, ok, tc.waiter, tc.fence, tc.ok)
		}
	}
}
