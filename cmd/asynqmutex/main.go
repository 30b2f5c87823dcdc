// Command asynqmutex shows and releases the Redis locks that the asynqmutex
// middleware and its mutex package take: who holds a key, since when, with which
// fence, and who waits for it. It also shows the per-key rate limits of package
// ratelimit, how many starts a key has left and when it is free again, and pauses
// and resumes them; and the order of a key's tasks (package order).
//
// Install it with:
//
//	go install github.com/asynqmutex/asynqmutex/cmd/asynqmutex@latest
//
// Usage:
//
//	asynqmutex [flags] list
//	asynqmutex [flags] show KEY
//	asynqmutex [flags] show --task TYPE [VALUE...]
//	asynqmutex [flags] release --force KEY
//	asynqmutex [flags] release --force --task TYPE [VALUE...]
//	asynqmutex [flags] rates
//	asynqmutex [flags] rate KEY | --task TYPE [VALUE...]
//	asynqmutex [flags] pause --for D [--every D] [--burst N] KEY | --task TYPE [VALUE...]
//	asynqmutex [flags] resume KEY | --task TYPE [VALUE...]
//	asynqmutex [flags] order [--skip N] KEY | --task TYPE [VALUE...]
//	asynqmutex [flags] order --blocked [--asynq_uri ADDR]
//	asynqmutex help
//
// list prints every held lock under the prefix, sorted by key: its holder (the task
// type and task ID the middleware records, host and process ID; a task whose turn
// it is in its key's order by its task type and place), how long it has been held,
// the lease left, its fence and how many waiters are queued: "12 (10 parked, oldest
// 4.2s)" says that 10 of them are tasks parked in the key's line, holding no worker
// (mutex.Park), the oldest of which has waited 4.2s.
//
// show prints one lock in full, with up to 100 of its waiters in the order they are
// served, and how many of all of them are parked, as list does. A key nobody holds is reported as not held, with the held keys of its
// task type, and exits with status 1.
//
// release --force frees a lock whoever holds it and hands it to the longest-queued
// waiter, if any. The holder is not told: it may still be working, and learns that
// it lost the lock only when it next renews or releases it (within a third of its
// lease under the middleware). Its fence is lower than every later holder's, so a
// resource that checks fences rejects its late writes. Without --force, release
// refuses. Releasing a key nobody holds changes nothing and exits with status 1.
//
// rates prints every rate-limited key under the prefix that Redis still remembers,
// sorted by key: its limit as one start every EVERY with up to BURST at once (the
// limit of its latest start; N per interval is not stored, only the spacing), how
// many starts may begin now, the time until the next one may, until every start of
// the burst is free again (RESET), the pause left, and the starts remembered (those
// of the last 10 to 20 seconds and those reserved ahead). rate prints one key so; a
// key Redis remembers nothing of is reported as idle (its next start may begin now;
// Redis forgets a limited key 10 to 20 seconds after its last start), with the
// limited keys of its task type, and exits with status 1: it may be mistyped.
//
// pause --for D lets no start of the key begin for D, on every worker; after it the
// key's starts come one at a time at its spacing. A pause is kept as a time under
// the key's limit, so pause takes the limit Redis remembers for the key, or the one
// --every (the spacing of starts) and --burst give; a key Redis remembers no start
// of needs --every. A pause or starts that already hold the key back longer stay.
// resume ends a key's pause at once (starts already taken keep their times); a key
// with no pause left is reported, and exits with status 1.
//
// order prints a key's order (InOrder): the place whose turn it is, the task that
// holds it, the places taken and not finished, and those skipped; a key without an
// order is reported with the ordered keys of its task type, and exits with status
// 1. order --skip N moves the key past its next place, N, whose task will not come.
//
// order --blocked lists every ordered key whose next place's task is not running,
// sorted by key: the place, the places not finished, the task it waits for, how long
// ago that task took its place, and why, as asynq's Inspector says (pending, scheduled
// or waiting for a retry in a queue no running server reads; pending behind other
// tasks; due at a time; archived, completed, not in asynq or abandoned, which the key
// moves past when its next task asks). A key whose task runs is left out. A key whose
// task is still to run in a queue no server reads is stuck: it will not move on by
// itself, and the command exits with status 1, naming the order --skip that moves
// it on. asynq's Redis is the one connected to, or the one --asynq_uri names.
//
// A KEY is the lock key as the lock was taken on, for the middleware the JSON array
// of the task type and the On fields: '["payment:capture","c-42"]' (quote it for
// the shell); a rate limit's key is named the same way. --task builds that key the
// way On does, as asynqmutex.Key does, from the task type and the field values in
// On's order, each given as JSON text: '"42"' is the string 42 and 42 the number. A
// value that is not JSON text, which Key refuses, is taken as a string, so c-42 is
// the string "c-42". A value that starts with a dash goes after --, which ends the
// flags. A payload may hold 42 or "42", different keys: show, rate and order look a
// value typed without quotes that JSON reads as a number, a boolean or null up in
// both forms, show the one Redis has, and name the other.
//
// Flags may come before or after the command:
//
//	-u, --uri ADDR         Redis address host:port, or a redis://, rediss:// or
//	                       unix:// URL (default 127.0.0.1:6379, or $REDIS_URL)
//	-n, --db N             Redis database number (default 0)
//	-p, --password PASS    Redis password
//	    --cluster          connect to a Redis Cluster
//	    --cluster_addrs A  comma-separated cluster node addresses
//	    --tls              use TLS, verifying the server's certificate for its host
//	    --tls_server NAME  use TLS, verifying the certificate for NAME
//	    --insecure         use TLS without verifying the certificate
//	    --prefix P         key prefix of the locks, rate limits and orders (default "asynqmutex:")
//	    --json             print one JSON document instead of text
//	    --force            release: take the lock from its holder
//	    --task TYPE        show, release, rate, pause, resume, order: the key of a task of type TYPE
//	    --for D            pause: how long (30s, 5m)
//	    --every D          pause: the spacing of the key's starts (100ms)
//	    --burst N          pause: the key's burst (default 1 with --every)
//	    --skip N           order: move the key past its next place, N
//	    --blocked          order: list the ordered keys whose next task is not running
//	    --asynq_uri ADDR   order --blocked: asynq's Redis, when not the locks' one:
//	                       host:port, or a redis://, rediss:// or unix:// URL
//
// Without --uri and --cluster, the address comes from the environment variable
// REDIS_URL (redis://[user:password@]host:port[/db] or rediss:// for TLS) when it is
// set; flags given explicitly override what the URL says. An ACL user name can be
// given only in such a URL.
//
// With --json, durations are in milliseconds (lease_left_ms is -1 for a key without
// expiry; parked_for_ms, the oldest parked task's wait, is null when none is parked),
// times are RFC 3339, and no lock token is ever printed. A rate key's
// times to wait (next_ms, reset_ms, paused_ms) are rounded up, so that 0 means now;
// its interval_ms keeps microseconds as a fraction. order --blocked prints an array,
// one object per key: key, digested, redis_key, place, waiting, task_id, queue,
// age_ms, state (asynq's task state, or not_in_asynq, abandoned, no_task), due,
// queue_served, stuck and reason.
//
// Exit status: 0 on success, 1 when Redis could not be reached or answered with an
// error, or the key asked for was not found (show, rate, order; with --json the
// document is printed too), or release found nothing to release, resume no pause,
// order --skip not that place, or order --blocked a stuck key (its list is printed
// too), 2 for a usage error.
//
// Examples:
//
//	asynqmutex list
//	asynqmutex --uri redis.internal:6379 --db 2 list --json
//	asynqmutex show '["payment:capture","c-42"]'
//	asynqmutex show --task payment:capture c-42
//	REDIS_URL=rediss://:secret@redis.internal:6380 asynqmutex release --force --task payment:capture c-42
//	asynqmutex --cluster --cluster_addrs 10.0.0.1:7000,10.0.0.2:7000 list
//	asynqmutex rates --json
//	asynqmutex rate --task payment:capture c-42
//	asynqmutex pause --for 30s --task email:send t-1
//	asynqmutex pause --for 5m --every 600ms --burst 5 '["payment:capture","c-42"]'
//	asynqmutex resume --task email:send t-1
//	asynqmutex order --blocked --json
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/asynqmutex/asynqmutex/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
