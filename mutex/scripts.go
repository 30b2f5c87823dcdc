package mutex

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// Every Redis step is one Lua script, so that compare-and-act is atomic and costs one
// round trip. redis.Script sends EVALSHA and falls back to EVAL on NOSCRIPT, which
// also loads the script for the next call. Each file documents its KEYS and ARGV.
var (
	//go:embed lock.lua
	lockLua    string
	lockScript = redis.NewScript(lockLua)

	//go:embed release.lua
	releaseLua    string
	releaseScript = redis.NewScript(releaseLua)

	//go:embed unwait.lua
	unwaitLua    string
	unwaitScript = redis.NewScript(unwaitLua)

	//go:embed extend.lua
	extendLua    string
	extendScript = redis.NewScript(extendLua)

	//go:embed pttl.lua
	pttlLua    string
	pttlScript = redis.NewScript(pttlLua)

	//go:embed locked.lua
	lockedLua    string
	lockedScript = redis.NewScript(lockedLua)
)
