package redistest

import "syscall"

// dieWithParent makes the kernel kill redis-server when the process that started it
// dies, so a test binary that crashes or is killed by a timeout leaves no server behind.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
