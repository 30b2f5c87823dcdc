// Package metrics exports Prometheus metrics of asynqmutex locks, built on the events
// of package mutex and of the asynqmutex middleware: how long acquisitions wait and locks are held, how often keys are
// contended, how many acquisitions wait now, how rate limits hold tasks back, and what
// went wrong (conflicts by policy, lost leases, failed renewals, tasks without a key,
// lost wake-ups).
//
// A Collector is a prometheus.Collector whose Observe method is given to the lock
// Client, and its ObserveTask method to the middleware:
//
//	m := metrics.New()
//	reg.MustRegister(m) // or prometheus.MustRegister(m)
//	locks := mutex.New(rdb, mutex.Observe(m.Observe))
//	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("report:build"), asynqmutex.On("tenant"),
//		asynqmutex.Observe(m.ObserveTask)))
//
// Every name carries the prefix "asynqmutex_", as asynq's own x/metrics carry
// "asynq_". Times are in seconds, counters end in _total:
//
//	asynqmutex_lock_wait_seconds           histogram  task_type, outcome  acquisitions by how they ended, and how long they took
//	asynqmutex_lock_hold_seconds           histogram  task_type           locks released by their holder, and how long they were held
//	asynqmutex_lock_waiters                gauge      task_type           acquisitions waiting for a busy key now
//	asynqmutex_lock_contended_total        counter    task_type           acquisitions that found the key held by another
//	asynqmutex_lease_lost_total            counter    task_type           leases lost while the holder counted on them
//	asynqmutex_lease_renew_failures_total  counter    task_type           renewals that got no answer (the lease still stood)
//	asynqmutex_lock_release_failures_total counter    task_type           releases that got no answer (the lease frees the key)
//	asynqmutex_task_conflicts_total        counter    task_type, policy   tasks the middleware did not run because their key was busy
//	asynqmutex_task_bad_input_total        counter    task_type           tasks archived because no key could be derived
//	asynqmutex_task_rate_limited_total     counter    task_type, policy   tasks not run because their key was at its rate limit or paused
//	asynqmutex_task_rate_wait_seconds      histogram  task_type           tasks that waited for their start under a rate limit, and how long
//	asynqmutex_key_pauses_total            counter    task_type           keys paused by a handler (asynqmutex.PauseKey)
//	asynqmutex_wakeup_lost_total           counter    (none)              subscription connections for hand-overs that broke
//	asynqmutex_wakeup_recovered_total      counter    (none)              ... and came back
//
// outcome is "acquired", "not_obtained" (the key stayed busy until the wait ended,
// or the caller's context ended it) or "error" (Redis could not be reached); the
// count of asynqmutex_lock_wait_seconds by outcome is the number of acquisitions
// by outcome. policy is "skip", "fail", "retry" or "archive" (see the asynqmutex
// middleware's OnConflict).
//
// # Labels are bounded
//
// No metric is labelled by lock key or task ID: there can be any number of them. The
// task_type label is a lock event's Name, which is what the holder passed to
// mutex.HeldBy (the task type under the asynqmutex middleware, "" for a lock taken
// without HeldBy), or a middleware event's TaskType. Shown whole up to 100 bytes and shortened with a digest beyond (as
// mutex.HeldBy stores it), it takes at most MaxTaskTypes distinct values (1000 by
// default) besides ""; events of any later task type are counted under task_type
// "other", so that a program that makes task types from data cannot grow the
// metrics without bound.
package metrics
