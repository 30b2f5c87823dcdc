package cli

import (
	"bytes"
	"encoding/json"
	"flag"
	"io"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// invocation is a parsed command line.
type invocation struct {
	cmd  string   // list, show, release, rates, rate, pause, resume, reset or order; "" when none was given
	args []string // the arguments after the command

	uri, password, clusterAddrs, tlsServer, prefix, task string
	db                                                   int
	cluster, tls, insecure, json, force, help            bool
	asynqURI                                             string // order --blocked: --asynq_uri, asynq's Redis

	every, pauseFor time.Duration // pause: --every and --for
	burst           int           // pause: --burst
	skip            int64         // order: --skip, the place to move the key past
	blocked         bool          // order: --blocked, list the keys whose next task is not running

	set map[string]bool // flags given on the command line, by long name
}

// defaultClusterAddrs is asynq's own CLI default, so the two agree.
const defaultClusterAddrs = "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005"

// shortNames maps the one-letter flags asynq's CLI also has to their long names.
var shortNames = map[string]string{"u": "uri", "n": "db", "p": "password", "h": "help"}

func (inv *invocation) flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("asynqmutex", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // run reports errors itself, usage included
	for _, name := range []string{"uri", "u"} {
		fs.StringVar(&inv.uri, name, "127.0.0.1:6379", "")
	}
	for _, name := range []string{"db", "n"} {
		fs.IntVar(&inv.db, name, 0, "")
	}
	for _, name := range []string{"password", "p"} {
		fs.StringVar(&inv.password, name, "", "")
	}
	for _, name := range []string{"help", "h"} {
		fs.BoolVar(&inv.help, name, false, "")
	}
	fs.BoolVar(&inv.cluster, "cluster", false, "")
	fs.StringVar(&inv.clusterAddrs, "cluster_addrs", defaultClusterAddrs, "")
	fs.BoolVar(&inv.tls, "tls", false, "")
	fs.StringVar(&inv.tlsServer, "tls_server", "", "")
	fs.BoolVar(&inv.insecure, "insecure", false, "")
	fs.StringVar(&inv.prefix, "prefix", mutex.DefaultPrefix, "")
	fs.BoolVar(&inv.json, "json", false, "")
	fs.BoolVar(&inv.force, "force", false, "")
	fs.StringVar(&inv.task, "task", "", "")
	fs.DurationVar(&inv.every, "every", 0, "")
	fs.IntVar(&inv.burst, "burst", 0, "")
	fs.DurationVar(&inv.pauseFor, "for", 0, "")
	fs.Int64Var(&inv.skip, "skip", 0, "")
	fs.BoolVar(&inv.blocked, "blocked", false, "")
	fs.StringVar(&inv.asynqURI, "asynq_uri", "", "")
	return fs
}

// parseArgs reads a command line whose flags may come before or after the command
// and its arguments. "--" ends the flags; an argument that looks like a negative
// number ("-5") is an argument, not a flag, so --task values may be negative.
func parseArgs(args []string) (*invocation, error) {
	inv := &invocation{set: map[string]bool{}}
	fs := inv.flagSet()
	var flags, rest []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			rest = append(rest, args[i+1:]...)
			break
		}
		if !isFlag(a) {
			rest = append(rest, a)
			continue
		}
		flags = append(flags, a)
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		f := fs.Lookup(name)
		if f == nil || hasValue || isBoolFlag(f) {
			continue // an unknown flag is reported by Parse below
		}
		if i+1 < len(args) {
			i++
			flags = append(flags, args[i])
		}
	}
	if err := fs.Parse(flags); err != nil {
		return nil, usagef("%s", longDashes(err.Error()))
	}
	fs.Visit(func(f *flag.Flag) {
		name := f.Name
		if long, ok := shortNames[name]; ok {
			name = long
		}
		inv.set[name] = true
	})
	if inv.help {
		return inv, nil
	}
	if len(rest) > 0 {
		inv.cmd, inv.args = rest[0], rest[1:]
	}
	return inv, inv.validate()
}

// flagName is a flag as package flag names it in its errors: -db, -u.
var flagName = regexp.MustCompile(`(^|[ :])-([a-z_]{2,})\b`)

// longDashes writes the long flags in a package flag error as they are documented,
// --db rather than -db.
func longDashes(msg string) string {
	return flagName.ReplaceAllString(msg, "$1--$2")
}

func isFlag(a string) bool {
	return len(a) > 1 && a[0] == '-' && !strings.ContainsRune("0123456789.", rune(a[1]))
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// validate rejects flags and arguments that do not fit together.
func (inv *invocation) validate() error {
	switch inv.cmd {
	case "", "list", "show", "release", "rates", "rate", "pause", "resume", "reset", "order":
	case "help":
		inv.help = true
		return nil
	default:
		return usagef("unknown command %s; the commands are list, show, release, rates, rate, pause, resume, reset and order", shortkey.Quote(inv.cmd))
	}
	switch inv.cmd {
	case "list":
		if len(inv.args) > 0 {
			return usagef("list takes no arguments, got %s", shortkey.Quote(inv.args[0]))
		}
		if inv.set["task"] {
			return usagef("--task goes with show and release, not list")
		}
	case "rates":
		if len(inv.args) > 0 {
			return usagef("rates takes no arguments, got %s; to see one key, run 'asynqmutex rate KEY'", shortkey.Quote(inv.args[0]))
		}
		if inv.set["task"] {
			return usagef("--task goes with rate, pause, resume and reset, not rates")
		}
	}
	if inv.set["skip"] && inv.cmd != "order" {
		return usagef("--skip goes with order only")
	}
	if inv.set["skip"] && inv.skip < 1 {
		return usagef("--skip %d: give the place to move the key past, as order shows it (1 or more)", inv.skip)
	}
	if err := inv.validateBlocked(); err != nil {
		return err
	}
	if inv.force && inv.cmd != "release" {
		return usagef("--force goes with release only")
	}
	if err := inv.validatePause(); err != nil {
		return err
	}
	if strings.ContainsAny(inv.prefix, "{}") {
		return usagef("--prefix %s must not contain '{' or '}'", shortkey.Quote(inv.prefix))
	}
	if inv.cluster {
		if inv.set["uri"] {
			return usagef("--uri does not go with --cluster: give the cluster's nodes with --cluster_addrs")
		}
		if inv.db != 0 {
			return usagef("--db does not go with --cluster: a Redis Cluster has only database 0")
		}
	} else if inv.set["cluster_addrs"] {
		return usagef("--cluster_addrs needs --cluster")
	}
	return nil
}

// validateBlocked checks order --blocked, which lists keys and so takes none, and
// --asynq_uri, which only it uses.
func (inv *invocation) validateBlocked() error {
	switch {
	case inv.set["blocked"] && inv.cmd != "order":
		return usagef("--blocked goes with order only")
	case inv.set["asynq_uri"] && !inv.blocked:
		return usagef("--asynq_uri goes with order --blocked only")
	case !inv.blocked:
		return nil
	case inv.set["skip"]:
		return usagef("--blocked lists the blocked keys and --skip moves one on: give one of them")
	case inv.set["task"] || len(inv.args) > 0:
		return usagef("order --blocked lists every blocked key and takes no KEY or --task; to see one key, run 'asynqmutex order KEY'")
	}
	return nil
}

// validatePause checks pause's flags: --for always, --every and --burst when given,
// and none of them with another command.
func (inv *invocation) validatePause() error {
	if inv.cmd != "pause" {
		for _, name := range []string{"for", "every", "burst"} {
			if inv.set[name] {
				return usagef("--%s goes with pause only", name)
			}
		}
		return nil
	}
	switch {
	case !inv.set["for"]:
		return usagef("pause needs --for DURATION: how long no start of the key may begin (30s, 5m)")
	case inv.pauseFor <= 0 || inv.pauseFor > ratelimit.MaxPer:
		return usagef("--for %v is outside (0, %v]", inv.pauseFor, ratelimit.MaxPer)
	case inv.set["every"] && (inv.every < time.Microsecond || inv.every > ratelimit.MaxPer):
		return usagef("--every %v is outside [1µs, %v]", inv.every, ratelimit.MaxPer)
	case inv.set["burst"] && (inv.burst < 1 || inv.burst > ratelimit.MaxBurst):
		return usagef("--burst %d is outside [1, %d]", inv.burst, ratelimit.MaxBurst)
	}
	return nil
}

// targetKey returns the key show, release, rate, pause, resume, reset and order act on:
// the argument, or with --task the key On derives. It returns "" for list, rates
// and order --blocked.
func (inv *invocation) targetKey() (string, error) {
	if inv.cmd == "list" || inv.cmd == "rates" || inv.blocked {
		return "", nil
	}
	if inv.set["task"] {
		if inv.task == "" {
			return "", usagef("--task needs a task type")
		}
		key, err := taskKey(inv.task, inv.args)
		if err != nil {
			return "", inv.valueError(err)
		}
		return key, nil
	}
	switch len(inv.args) {
	case 0:
		if inv.cmd == "rate" {
			return "", usagef("rate needs a KEY, or --task TYPE [VALUE...]; 'asynqmutex rates' lists every limited key")
		}
		return "", usagef("%s needs a KEY, or --task TYPE [VALUE...]", inv.cmd)
	case 1:
		if inv.args[0] == "" {
			return "", usagef("%s: the KEY is empty", inv.cmd)
		}
		return normalKey(inv.args[0]), nil
	default:
		return "", usagef("%s takes one KEY, got %d arguments: quote a key with spaces, or use --task TYPE VALUE...", inv.cmd, len(inv.args))
	}
}

// valueNumber finds the value asynqmutex.Key's error names.
var valueNumber = regexp.MustCompile(`^asynqmutex\.Key: value (\d+)`)

// valueError is the usage error for err, asynqmutex.Key's refusal of a --task
// value, in the command's terms and with what to type for the text as a string.
func (inv *invocation) valueError(err error) error {
	msg := strings.TrimPrefix(err.Error(), "asynqmutex.Key: ")
	m := valueNumber.FindStringSubmatch(err.Error())
	if m == nil {
		return usagef("--task %s", msg)
	}
	n, _ := strconv.Atoi(m[1])
	if n < 1 || n > len(inv.args) {
		return usagef("--task %s", msg)
	}
	return usagef("--task %s; to give the text %s as a string, type it in double quotes: %s", msg,
		shortkey.Quote(inv.args[n-1]), shellQuote(jsonString(inv.args[n-1])))
}

// taskKey is asynqmutex.Key with every value that is not JSON text taken as a
// string: each value Key accepts means what it means to Key, and one it refuses as
// not JSON text (tx-42, where Key wants "tx-42") is the string typed.
func taskKey(taskType string, values []string) (string, error) {
	vals := make([]string, len(values))
	for i, v := range values {
		vals[i] = v
		if !json.Valid([]byte(v)) {
			vals[i] = jsonString(v)
		}
	}
	return asynqmutex.Key(taskType, vals...)
}

// jsonString is s as a JSON string.
func jsonString(s string) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a string always encodes
	return strings.TrimSuffix(b.String(), "\n")
}

// givenKey is the KEY argument as typed, or "" with --task.
func (inv *invocation) givenKey() string {
	if inv.set["task"] || len(inv.args) != 1 {
		return ""
	}
	return inv.args[0]
}
