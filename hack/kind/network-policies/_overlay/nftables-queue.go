// Built in place of github.com/google/nftables@v0.3.0/expr/queue.go when
// hack/cluster-binaries.sh builds kube-network-policies (`go build -overlay`): nothing
// else of the module changes.
//
// Why: kube-network-policies sends the first packet of each connection to its NFQUEUE
// with nftables' native `queue` expression, which needs the kernel's nft_queue
// (CONFIG_NFT_QUEUE). The kernels of the machines this project runs kind on are built
// without it (adding such a rule fails with ENOENT), so the enforcer would program no
// rule and enforce nothing. The same verdict exists as xtables' NFQUEUE target (revision
// 3, xt_NFQ_info_v3), which nftables runs through nft_compat (iptables-nft's own path,
// present in those kernels and as modules in distribution kernels); `nft list ruleset`
// even prints it back as `queue num N bypass`. So a Queue marshals as that target; every
// field keeps its meaning (the flag bits of NFQ_FLAG_* equal NFT_QUEUE_FLAG_*).
package expr

import (
	"encoding/binary"

	"github.com/google/nftables/xt"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

type QueueAttribute uint16

type QueueFlag uint16

// The module's names and values, unchanged.
const (
	QueueNum   QueueAttribute = unix.NFTA_QUEUE_NUM
	QueueTotal QueueAttribute = unix.NFTA_QUEUE_TOTAL
	QueueFlags QueueAttribute = unix.NFTA_QUEUE_FLAGS

	QueueFlagBypass QueueFlag = unix.NFT_QUEUE_FLAG_BYPASS
	QueueFlagFanout QueueFlag = unix.NFT_QUEUE_FLAG_CPU_FANOUT
	QueueFlagMask   QueueFlag = unix.NFT_QUEUE_FLAG_MASK
)

// Queue hands the packet to user space on queue Num (Total queues from Num on).
type Queue struct {
	Num   uint16
	Total uint16
	Flag  QueueFlag
}

// nfqueueInfoLen is sizeof(struct xt_NFQ_info_v3) (three __u16) rounded up to the
// 8-byte alignment xtables checks target sizes against (XT_ALIGN).
const nfqueueInfoLen = 8

// asTarget is the xtables NFQUEUE target with the same queue, count and flags.
func (e *Queue) asTarget() *Target {
	total := e.Total
	if total == 0 {
		total = 1 // as nftables' queue expression defaults it
	}
	info := make(xt.Unknown, nfqueueInfoLen)
	binary.NativeEndian.PutUint16(info[0:], e.Num)          // queuenum
	binary.NativeEndian.PutUint16(info[2:], total)          // queues_total
	binary.NativeEndian.PutUint16(info[4:], uint16(e.Flag)) // flags
	return &Target{Name: "NFQUEUE", Rev: 3, Info: &info}
}

func (e *Queue) marshal(fam byte) ([]byte, error) {
	return e.asTarget().marshal(fam)
}

func (e *Queue) marshalData(fam byte) ([]byte, error) {
	return e.asTarget().marshalData(fam)
}

// unmarshal reads a native queue expression (a rule someone else wrote); the rules this
// build writes read back as a Target.
func (e *Queue) unmarshal(fam byte, data []byte) error {
	ad, err := netlink.NewAttributeDecoder(data)
	if err != nil {
		return err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_QUEUE_NUM:
			e.Num = ad.Uint16()
		case unix.NFTA_QUEUE_TOTAL:
			e.Total = ad.Uint16()
		case unix.NFTA_QUEUE_FLAGS:
			e.Flag = QueueFlag(ad.Uint16())
		}
	}
	return ad.Err()
}
