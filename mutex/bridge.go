package mutex

import (
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/link"
)

// The asynqmutex middleware keeps a record of each task's conflicts next to its
// locks, under the same prefix; link hands it the Client's Redis and prefix.
func init() {
	link.Redis = func(c any) (redis.UniversalClient, string) {
		cl := c.(*Client)
		return cl.rdb, cl.prefix
	}
}
