//go:build !linux

package redistest

import "syscall"

// dieWithParent has no portable equivalent outside Linux: a server outlives a test
// binary that is killed before its cleanup runs.
func dieWithParent() *syscall.SysProcAttr { return nil }
