package ratelimit

import (
	"embed"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Every Redis step is one Lua script, so that a decision is atomic and costs one
// round trip; every script goes through the Limiter's store.Runner. Each script in
// lua/ is headed by what its KEYS and ARGV mean and starts with luaLayout
// (layout.go) and common.lua; together they are one Redis function library, called
// with FCALL where the server and the user's ACL allow, and by EVALSHA elsewhere.
var (
	//go:embed lua/*.lua
	luaFiles embed.FS

	takeScript    = script("take")
	cancelScript  = script("cancel").Flag(store.AllowOOM)  // writes only ZREM
	confirmScript = script("confirm").Flag(store.AllowOOM) // writes only ZREM
	pauseScript   = script("pause")
	resumeScript  = script("resume").Flag(store.AllowOOM) // writes only ZREM
	resetScript   = script("reset").Flag(store.AllowOOM)  // writes only ZREM
	inspectScript = script("inspect").Flag(store.NoWrites)

	scriptsLibrary = store.NewLibrary("asynqmutex_rate", takeScript, cancelScript, confirmScript, pauseScript, resumeScript, resetScript, inspectScript)
)

func script(name string) *store.Script {
	return store.NewScript(name, luaLayout+"\n"+lua("common"), lua(name))
}

func lua(name string) string {
	b, err := luaFiles.ReadFile("lua/" + name + ".lua")
	if err != nil {
		panic("ratelimit: missing script " + name + ": " + err.Error())
	}
	return string(b)
}
