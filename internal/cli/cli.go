// Package cli is the asynqmutex command (cmd/asynqmutex), kept apart from its main
// package so that examples and tests can run it in process. See the command's
// documentation for its usage.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Run runs the command with args (without the program name), reading the
// environment through env (os.Getenv) and writing to stdout and stderr. It returns
// the exit status: 0 success, 1 Redis unreachable or failing (or the key asked for
// not found, or nothing to release, resume, reset or skip), 2 a usage error. Safe for
// concurrent use.
func Run(ctx context.Context, args []string, env func(string) string, stdout, stderr io.Writer) int {
	return run(ctx, args, env, stdout, stderr)
}

// Exit statuses.
const (
	exitOK      = 0
	exitFailure = 1 // Redis unreachable or failing, the key not found, or nothing to release, resume, reset or skip
	exitUsage   = 2
)

// usageError is a mistake on the command line: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// errReported means the command has already told the user what went wrong and
// only the exit status is left to set.
var errReported = errors.New("reported")

// run is the whole command: args without the program name, env to read the
// environment (os.Getenv), and the two output streams. It returns the exit status.
func run(ctx context.Context, args []string, env func(string) string, stdout, stderr io.Writer) int {
	inv, err := parseArgs(args)
	if err != nil {
		fmt.Fprintf(stderr, "asynqmutex: %v\nRun 'asynqmutex help' for usage.\n", err)
		return exitUsage
	}
	switch {
	case inv.help:
		fmt.Fprint(stdout, usage)
		return exitOK
	case inv.cmd == "":
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	err = execute(ctx, inv, env, stdout, stderr)
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "asynqmutex: %v\nRun 'asynqmutex help' for usage.\n", err)
		return exitUsage
	case errors.Is(err, errReported):
		return exitFailure
	default:
		fmt.Fprintf(stderr, "asynqmutex: %v\n", err)
		return exitFailure
	}
}

// execute connects to Redis and runs the command inv names.
func execute(ctx context.Context, inv *invocation, env func(string) string, stdout, stderr io.Writer) error {
	key, err := inv.targetKey()
	if err != nil {
		return err
	}
	forms, err := inv.forms(key)
	if err != nil {
		return err
	}
	if inv.cmd == "release" && !inv.force {
		return usagef("release needs --force to free %s: it takes the lock from its holder, which may still be\n"+
			"working and is not told until it next renews (within a third of its lease). Check first with\n"+
			"'asynqmutex show', then run 'asynqmutex release --force' with the same key", quoteKey(key))
	}
	conn, err := connect(inv, env)
	if err != nil {
		return err
	}
	defer conn.close()
	tasks := conn // order --blocked: asynq's Redis
	if inv.blocked {
		if tasks, err = conn.connectAsynq(inv); err != nil {
			return err
		}
		if tasks != conn {
			defer tasks.close()
		}
	}
	if err := conn.check(ctx); err != nil {
		return err
	}
	out := &printer{w: stdout, json: inv.json, prefix: inv.prefix}
	switch inv.cmd {
	case "list":
		return conn.explain(list(ctx, conn.locks, conn.orders, out))
	case "show":
		return conn.explain(show(ctx, conn.locks, forms, inv.givenKey(), out, stderr))
	case "release":
		return conn.explain(release(ctx, conn.locks, key, inv.givenKey(), out, stderr))
	case "rates":
		return conn.explain(rates(ctx, conn.rates, out))
	case "rate":
		return conn.explain(rateShow(ctx, conn.rates, forms, inv.givenKey(), out, stderr))
	case "pause":
		return conn.explain(pause(ctx, conn.rates, inv, key, out, stderr))
	case "order":
		if inv.blocked {
			return orderBlocked(ctx, conn, tasks, out, stderr)
		}
		if inv.set["skip"] {
			return conn.explain(orderSkip(ctx, conn.orders, key, inv.skip, out, stderr))
		}
		return conn.explain(orderShow(ctx, conn.orders, forms, inv.givenKey(), out, stderr))
	case "reset":
		return conn.explain(reset(ctx, conn.rates, key, inv.givenKey(), out, stderr))
	default: // resume
		return conn.explain(resume(ctx, conn.rates, key, inv.givenKey(), out, stderr))
	}
}

const usage = `asynqmutex shows and releases the Redis locks of asynqmutex (package mutex),
shows, pauses, resumes and resets its rate limits (package ratelimit), and shows the order
of a key's tasks (package order).

Usage:
  asynqmutex [flags] list
  asynqmutex [flags] show KEY
  asynqmutex [flags] show --task TYPE [VALUE...]
  asynqmutex [flags] release --force KEY
  asynqmutex [flags] release --force --task TYPE [VALUE...]
  asynqmutex [flags] rates
  asynqmutex [flags] rate KEY | --task TYPE [VALUE...]
  asynqmutex [flags] pause --for D [--every D] [--burst N] KEY | --task TYPE [VALUE...]
  asynqmutex [flags] resume KEY | --task TYPE [VALUE...]
  asynqmutex [flags] reset KEY | --task TYPE [VALUE...]
  asynqmutex [flags] order [--skip N] KEY | --task TYPE [VALUE...]
  asynqmutex [flags] order --blocked [--asynq_uri ADDR]
  asynqmutex help

Commands:
  list     every held lock under the prefix, sorted by key: holder (task ID
           cut to 8 characters; a task whose turn it is in its key's order by
           its task type and place), held for, lease left, fence, waiters
           ("12 (10 parked, oldest 4.2s)": 10 of them are tasks parked in the
           key's line, holding no worker, the oldest for 4.2s)
  show     one lock in full, with its waiters in the order they are served
  release  free a lock whoever holds it (needs --force); it goes to the first
           waiter, if any. The holder is not told until it next renews, and its
           fence is lower than every later holder's.
  rates    every rate-limited key under the prefix, sorted by key: its limit (one
           start every EVERY, up to BURST at once), starts that may begin now,
           time until the next start, until the burst is full again (reset),
           pause left, starts Redis remembers (those of the last 10 to 20 s
           and those reserved ahead), and of those the starts reserved ahead,
           each for a task that waits for it (parked, or in its worker)
  rate     one rate-limited key in full; a key Redis remembers nothing of is
           idle (its next start free now), or not the key meant
  pause    let no start of a key begin for --for, on every worker; after it,
           starts come one at a time at the key's spacing. The limit is the one
           Redis remembers for the key unless --every and --burst give it (needed
           for a key Redis remembers no start of). A longer hold stays.
  resume   end a key's pause now; starts already taken keep their times
  reset    forget a key's starts, those taken ahead too: its whole burst may
           begin now. A pause stays (resume ends it)
  order    a key's order (InOrder, package order): the place whose turn it is,
           the task that holds it (ID, queue, how long ago it took its place),
           places taken and not finished, places skipped. With --skip N, move
           the key past its next place N, whose task will not come (the workers
           do so themselves by docs/order.md's rules). With --blocked, every
           ordered key whose next place's task is not running, sorted by key: the
           place, places not finished, the task it waits for, how long ago it
           took its place, and why, as asynq says: pending or scheduled in a queue
           no server reads (stuck: it will not move on by itself), pending behind
           a backlog, waiting for a retry, archived, completed, not in asynq,
           abandoned. A key whose task is running is left out. asynq's Redis is
           the one connected to, unless --asynq_uri names another

Keys:
  KEY is the key the lock was taken on; for the middleware the JSON array of the
  task type and the On fields: '["payment:capture","c-42"]' (quote it). Such an
  array is read as the middleware writes it: spaces in it do not matter.
  --task TYPE [VALUE...] builds that key as asynqmutex.Key does, values in On's
  order, each JSON text: '"42"' is the string 42, 42 the number. A value that is
  not JSON text, which Key refuses, is a string here: c-42 means "c-42". Put
  values that start with - after --. A payload may hold 42 or "42", which are
  different keys: show, rate and order look up a value typed without quotes that
  JSON reads as a number, a boolean or null in both forms, show the one found,
  and name the other ("Other form"); quoted, only the string is looked up.
  When Redis has none of the forms, show, rate and order exit 1 and list the
  keys of the same task type it has (held, limited, ordered), with the --task
  form of each. release, resume and reset act on the key built, in no other form, and
  list the same when they find nothing to do. A rate limit's and an order's key
  are named as the lock's is.

Flags (before or after the command):
  -u, --uri ADDR         Redis host:port, or a redis://, rediss:// or unix:// URL
                         (default 127.0.0.1:6379, or $REDIS_URL when set)
  -n, --db N             Redis database number (default 0)
  -p, --password PASS    Redis password
      --cluster          connect to a Redis Cluster
      --cluster_addrs A  comma-separated cluster node addresses
                         (default 127.0.0.1:7000,...,127.0.0.1:7005)
      --tls              use TLS, verifying the certificate for the server's host
      --tls_server NAME  use TLS, verifying the certificate for NAME
      --insecure         use TLS without verifying the certificate
      --prefix P         key prefix of the locks, rate limits and orders
                         (default "asynqmutex:")
      --json             print one JSON document: durations in ms, RFC 3339 times
      --force            release: take the lock from its holder
      --task TYPE        show, release, rate, pause, resume, reset, order: the key of a task
                         of type TYPE
      --for D            pause: how long (30s, 5m)
      --every D          pause: the key's spacing of starts (100ms; 1m/N for
                         N a minute)
      --burst N          pause: the key's burst (default 1 with --every)
      --skip N           order: move the key past its next place, N
      --blocked          order: list the ordered keys whose next task is not running
      --asynq_uri ADDR   order --blocked: asynq's Redis, when not the locks' one:
                         host:port, or a redis://, rediss:// or unix:// URL (its
                         password, database and TLS in the URL)
  -h, --help             print this help

Environment:
  REDIS_URL  used without --uri and --cluster: redis://[user:pass@]host:port[/db],
             rediss:// for TLS. Flags given explicitly override it.

Exit status: 0 success, 1 Redis unreachable or failing, or the key not found
(show: nobody holds it; rate: Redis remembers nothing of it; order: it has no
order), or nothing to release, resume, reset or skip, or order --blocked found a stuck
key (its task in a queue no server reads; other blocked keys exit 0), 2 usage
error.
With --json, show, rate, order, release, resume and reset print their document also
when they exit 1 for the key, and order --blocked its array.

order --blocked --json prints an array, one object per key: key, digested,
redis_key, place, waiting (places not finished), task_id, queue, age_ms (since
the place was taken), state (asynq's: pending, scheduled, retry, aggregating,
active, archived, completed; or not_in_asynq, abandoned, no_task), due
(scheduled and retry), queue_served (a running server reads the queue), stuck,
reason.

Examples:
  asynqmutex list
  asynqmutex --uri redis.internal:6379 --db 2 list --json
  asynqmutex show '["payment:capture","c-42"]'
  asynqmutex show --task payment:capture c-42
  asynqmutex release --force --task payment:capture c-42
  asynqmutex --cluster --cluster_addrs 10.0.0.1:7000,10.0.0.2:7000 list
  asynqmutex rates
  asynqmutex rate --task payment:capture c-42
  asynqmutex pause --for 30s --task payment:capture c-42
  asynqmutex resume --task payment:capture c-42
  asynqmutex order --task transfer acct-7
  asynqmutex order --skip 2 --task transfer acct-7
  asynqmutex order --blocked --asynq_uri redis://asynq.internal:6379/1
`
