package mutex

import (
	"embed"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Every Redis step is one Lua script, so that compare-and-act is atomic and costs one
// round trip; every script goes through the Client's store.Runner. The scripts live in
// lua/, one file per step, named by the kind of lock it is for (plain_, slots_), each
// headed by what its KEYS and ARGV mean. Each starts with luaLayout (layout.go) and
// common.lua, then what its kind shares (line.lua, the parked entries of either kind's line;
// plain.lua, slots.lua): that is the source
// EVALSHA runs, whole, on every call. Together they are one Redis function library,
// scriptsLibrary, which runs those shared parts once, when the server loads it, and
// then each step as a function; the Runner calls the functions where the server and
// the user's ACL allow (Redis 7 and later), and falls back to EVALSHA elsewhere.
var (
	//go:embed lua/*.lua
	luaFiles embed.FS

	plainLockScript    = script("plain_lock", "line", "plain")
	plainReleaseScript = script("plain_release", "line", "plain")
	plainExtendScript  = script("plain_extend").Flag(store.AllowOOM) // writes only PEXPIRE
	plainPTTLScript    = script("plain_pttl").Flag(store.NoWrites)
	plainForceScript   = script("plain_force", "line", "plain")

	slotsLockScript    = script("slots_lock", "line", "slots")
	slotsReleaseScript = script("slots_release", "line", "slots")
	slotsExtendScript  = script("slots_extend")
	slotsPTTLScript    = script("slots_pttl").Flag(store.NoWrites)
	slotsFreeScript    = script("slots_free", "line", "slots")

	inspectScript = script("inspect").Flag(store.NoWrites)
	serveScript   = script("serve", "line", "plain", "slots")

	scriptsLibrary = store.NewLibrary("asynqmutex",
		plainLockScript, plainReleaseScript, plainExtendScript, plainPTTLScript, plainForceScript,
		slotsLockScript, slotsReleaseScript, slotsExtendScript, slotsPTTLScript, slotsFreeScript,
		inspectScript, serveScript)
)

// script is the script of lua/<name>.lua, after the layout, common.lua and the files
// of shared, in order.
func script(name string, shared ...string) *store.Script {
	parts := []string{luaLayout + "\n" + lua("common")}
	for _, s := range shared {
		parts = append(parts, lua(s))
	}
	return store.NewScript(name, append(parts, lua(name))...)
}

func lua(name string) string {
	b, err := luaFiles.ReadFile("lua/" + name + ".lua")
	if err != nil {
		panic("mutex: missing script " + name + ": " + err.Error())
	}
	return string(b)
}
