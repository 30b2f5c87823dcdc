// Command asynqmutex shows and releases the Redis locks that the asynqmutex
// middleware and its mutex package take: who holds a key, since when, with which
// fence, and who waits for it.
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
//	asynqmutex help
//
// list prints every held lock under the prefix, sorted by key: its holder (the task
// type and task ID the middleware records, host and process ID), how long it has
// been held, the lease left, its fence and how many waiters are queued.
//
// show prints one lock in full, with up to 100 of its waiters in the order they are
// served. A key nobody holds is reported as not held, with exit status 0.
//
// release --force frees a lock whoever holds it and hands it to the longest-queued
// waiter, if any. The holder is not told: it may still be working, and learns that
// it lost the lock only when it next renews or releases it (within a third of its
// lease under the middleware). Its fence is lower than every later holder's, so a
// resource that checks fences rejects its late writes. Without --force, release
// refuses. Releasing a key nobody holds changes nothing and exits with status 1.
//
// A KEY is the lock key as the lock was taken on, for the middleware the JSON array
// of the task type and the On fields: '["payment:capture","c-42"]' (quote it for
// the shell). --task builds that key the way On does, from the task type and the
// field values in On's order, each given as JSON text: '"42"' is the string 42 and
// 42 the number. A value that is not valid JSON is taken as a string, so c-42 is the
// string "c-42". A value that starts with a dash goes after --, which ends the flags.
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
//	    --prefix P         key prefix of the locks (default "asynqmutex:")
//	    --json             print one JSON document instead of text
//
// Without --uri and --cluster, the address comes from the environment variable
// REDIS_URL (redis://[user:password@]host:port[/db] or rediss:// for TLS) when it is
// set; flags given explicitly override what the URL says. An ACL user name can be
// given only in such a URL.
//
// With --json, durations are in milliseconds (lease_left_ms is -1 for a key without
// expiry), times are RFC 3339, and no lock token is ever printed.
//
// Exit status: 0 on success, 1 when Redis could not be reached or answered with an
// error (or release found nothing to release), 2 for a usage error.
//
// Examples:
//
//	asynqmutex list
//	asynqmutex --uri redis.internal:6379 --db 2 list --json
//	asynqmutex show '["payment:capture","c-42"]'
//	asynqmutex show --task payment:capture c-42
//	REDIS_URL=rediss://:secret@redis.internal:6380 asynqmutex release --force --task payment:capture c-42
//	asynqmutex --cluster --cluster_addrs 10.0.0.1:7000,10.0.0.2:7000 list
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
