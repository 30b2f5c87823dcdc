// Package link lets the asynqmutex middleware reach what a *mutex.Client keeps to
// itself, without widening package mutex's exported API: package mutex sets the
// functions here when it is initialised, which happens before any package that
// imports it runs.
package link

import "github.com/redis/go-redis/v9"

// Redis returns the Redis client and the key prefix of c, a *mutex.Client. It
// panics if c is anything else.
var Redis func(c any) (rdb redis.UniversalClient, prefix string)
