package mutex

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// Every Redis step is one Lua script, so that compare-and-act is atomic and costs one
// round trip. redis.Script sends EVALSHA and falls back to EVAL on NOSCRIPT, which
// also loads the script for the next call. Each file documents its KEYS and ARGV;
// common.lua, the lock value's format and the fence rule, starts every script;
// handover.lua, how a release passes the lock on, follows it in the two that release.
var (
	//go:embed common.lua
	commonLua string

	//go:embed handover.lua
	handoverLua string

	//go:embed lock.lua
	lockLua    string
	lockScript = newScript(lockLua)

	//go:embed release.lua
	releaseLua    string
	releaseScript = newScript(handoverLua + "\n" + releaseLua)

	//go:embed extend.lua
	extendLua    string
	extendScript = newScript(extendLua)

	//go:embed pttl.lua
	pttlLua    string
	pttlScript = newScript(pttlLua)

	//go:embed force.lua
	forceLua    string
	forceScript = newScript(handoverLua + "\n" + forceLua)

	//go:embed inspect.lua
	inspectLua    string
	inspectScript = newScript(inspectLua)

	//go:embed locked.lua
	lockedLua    string
	lockedScript = newScript(lockedLua)
)

func newScript(body string) *redis.Script { return redis.NewScript(commonLua + "\n" + body) }
