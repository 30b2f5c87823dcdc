package asynqmutex

import (
	"errors"
	"math/rand/v2"
	"time"

	"github.com/hibiken/asynq"
)

// IsFailure reports whether err counts as a failure for asynq: false for a
// *LockedError (a busy key), true otherwise. Install it as asynq.Config.IsFailure, or
// let Configure chain it with a function you already have.
func IsFailure(err error) bool {
	var le *LockedError
	return !errors.As(err, &le)
}

// RetryDelay is an asynq.Config.RetryDelayFunc: for a *LockedError it returns its
// RetryIn plus up to a quarter of it (at least up to a second) of random jitter, so
// tasks that met on a key do not meet again, except for a task that waits for its
// turn under InOrder, whose RetryIn stands: jitter would let the tasks of a key come
// back in another order than they left; for any other error it returns asynq's
// DefaultRetryDelayFunc. Because asynq passes n, the count of failures, and a busy key
// is not one, the growing delay for repeated conflicts comes from RetryIn itself.
func RetryDelay(n int, err error, t *asynq.Task) time.Duration {
	var le *LockedError
	if errors.As(err, &le) && le.RetryIn > 0 {
		if le.turn != nil {
			return le.RetryIn
		}
		return le.RetryIn + rand.N(le.RetryIn/4+time.Second)
	}
	return asynq.DefaultRetryDelayFunc(n, err, t)
}

// ParkedTaskCheck is the TaskCheckInterval Configure sets when none is given: asynq's
// servers, finding their queues empty, wait between half of it and one and a half
// times it before they look again, so a task made pending waits about that long for
// an idle server.
const ParkedTaskCheck = 20 * time.Millisecond

// Configure returns cfg with IsFailure and RetryDelayFunc set so that a busy key
// (a *LockedError) is not a failure and is retried after its RetryIn. Functions
// already set in cfg keep deciding for every other error. Use it when building the
// server: asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{...})).
//
// It also sets TaskCheckInterval to ParkedTaskCheck when cfg leaves it zero (asynq's
// default is 1s): an idle server looks for tasks that often, and a parked task that
// is started ahead of its turn (see Park) must arrive while the task before it runs.
// An idle server then runs asynq's dequeue script about 50 times a second (3 Redis
// commands, counting its own), where asynq's default runs it once a second. With many
// servers on one Redis, set TaskCheckInterval higher yourself: on an idle fleet a hot
// key's next task then waits up to about that long for a worker.
//
// Configure leaves cfg.ErrorHandler alone, and asynq calls it for every error a
// handler returns, each busy key's *LockedError included. To report real failures
// only, skip those: var le *asynqmutex.LockedError; if errors.As(err, &le) { return }.
func Configure(cfg asynq.Config) asynq.Config {
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = ParkedTaskCheck
	}
	isFailure, retryDelay := cfg.IsFailure, cfg.RetryDelayFunc
	cfg.IsFailure = func(err error) bool {
		if !IsFailure(err) {
			return false
		}
		if isFailure != nil {
			return isFailure(err)
		}
		return true
	}
	cfg.RetryDelayFunc = func(n int, err error, t *asynq.Task) time.Duration {
		var le *LockedError
		if errors.As(err, &le) || retryDelay == nil {
			return RetryDelay(n, err, t)
		}
		return retryDelay(n, err, t)
	}
	return cfg
}
