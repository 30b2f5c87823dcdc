package order

import (
	"embed"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Every Redis step is one Lua script, so that it is atomic and costs one round trip;
// every script goes through the Sequencer's store.Runner. Each script in lua/ is
// headed by what its KEYS and ARGV mean and starts with luaLayout (layout.go) and
// common.lua; together they are one Redis function library, called with FCALL where
// the server and the user's ACL allow, and by EVALSHA elsewhere.
var (
	//go:embed lua/*.lua
	luaFiles embed.FS

	takeScript    = script("take")
	enterScript   = script("enter").Flag(store.NoWrites)
	parkScript    = script("park")
	aheadScript   = script("ahead")
	finishScript  = script("finish")
	requeueScript = script("requeue") // it only publishes, which a no-writes function may not
	inspectScript = script("inspect").Flag(store.NoWrites)

	scriptsLibrary = store.NewLibrary("asynqmutex_order", takeScript, enterScript, parkScript, aheadScript, finishScript, requeueScript, inspectScript)
)

func script(name string) *store.Script {
	return store.NewScript(name, luaLayout+"\n"+lua("common"), lua(name))
}

func lua(name string) string {
	b, err := luaFiles.ReadFile("lua/" + name + ".lua")
	if err != nil {
		panic("order: missing script " + name + ": " + err.Error())
	}
	return string(b)
}
