// Command ctj-kind-routes is the kind cluster's pod network (kind's own kindnetd is
// not on the Go module proxy, and no registry is reachable for its image).
//
// It runs on every node as a hostNetwork DaemonSet pod (hack/kind/cni.yaml) and keeps
// three things current from the API server's Nodes (a list, then a watch, and a full
// pass every few seconds so a route someone removed comes back):
//
//   - this node's CNI config: ptp + host-local IPAM over the node's podCIDR, written
//     atomically (and only when it changes) to $CNI_CONFIG;
//   - one route per other node: `ip route replace <its podCIDR> via <its InternalIP>`,
//     tagged with routing protocol 77 so routes of nodes that are gone can be found
//     and deleted; a node whose container restarted with a new IP gets its route
//     moved as soon as its kubelet reports the new address;
//   - an iptables NAT chain that masquerades pod traffic leaving the pod subnet (to
//     the Docker network and beyond); pod to pod traffic keeps the pod's address.
//
// Routes and rules stay in place when the agent exits, so a restart or a rolling
// update of the DaemonSet never cuts the network.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	saDir       = "/var/run/secrets/kubernetes.io/serviceaccount"
	routeProto  = "77" // marks the routes this agent owns
	masqChain   = "CTJ-MASQ"
	resyncEvery = 5 * time.Second
)

type nodeInfo struct {
	name  string
	cidrs []string // IPv4 pod CIDRs
	ip    string   // IPv4 InternalIP
}

type agent struct {
	self       string
	podSubnets []string
	cniConfig  string
	api        string
	client     *http.Client

	mu    sync.Mutex
	nodes map[string]nodeInfo

	lastConf   []byte
	masqUntil  time.Time
	masqNodes  string // the node addresses CTJ-MASQ last returned for, sorted, joined
	reconcileC chan struct{}
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	a, err := newAgent()
	if err != nil {
		log.Fatalf("ctj-kind-routes: %v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go a.reconcileLoop(ctx)
	a.listWatchLoop(ctx)
	log.Printf("exiting (routes and rules stay in place)")
}

func newAgent() (*agent, error) {
	self := os.Getenv("NODE_NAME")
	if self == "" {
		return nil, errors.New("NODE_NAME is not set")
	}
	var subnets []string
	for _, s := range strings.Split(os.Getenv("POD_SUBNET"), ",") {
		s = strings.TrimSpace(s)
		if _, n, err := net.ParseCIDR(s); err == nil && n.IP.To4() != nil {
			subnets = append(subnets, n.String())
		}
	}
	if len(subnets) == 0 {
		return nil, fmt.Errorf("POD_SUBNET %q has no IPv4 CIDR", os.Getenv("POD_SUBNET"))
	}
	conf := os.Getenv("CNI_CONFIG")
	if conf == "" {
		conf = "/etc/cni/net.d/10-ctj-kind.conflist"
	}
	// kind patches CONTROL_PLANE_ENDPOINT in (host:port of the API server on the Docker
	// network): it works before kube-proxy has written the Service rules.
	endpoint := os.Getenv("CONTROL_PLANE_ENDPOINT")
	if endpoint == "" {
		endpoint = net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	}
	caPEM, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("no certificate in the service account's ca.crt")
	}
	tr := &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
	}
	log.Printf("node %s, pod subnets %v, API https://%s, CNI config %s", self, subnets, endpoint, conf)
	return &agent{
		self: self, podSubnets: subnets, cniConfig: conf, api: "https://" + endpoint,
		client: &http.Client{Transport: tr}, nodes: map[string]nodeInfo{},
		reconcileC: make(chan struct{}, 1),
	}, nil
}

// ---- API: list and watch Nodes ----------------------------------------------------

type apiNode struct {
	Metadata struct {
		Name            string `json:"name"`
		ResourceVersion string `json:"resourceVersion"`
	} `json:"metadata"`
	Spec struct {
		PodCIDR  string   `json:"podCIDR"`
		PodCIDRs []string `json:"podCIDRs"`
	} `json:"spec"`
	Status struct {
		Addresses []struct {
			Type    string `json:"type"`
			Address string `json:"address"`
		} `json:"addresses"`
	} `json:"status"`
}

func (n apiNode) info() nodeInfo {
	out := nodeInfo{name: n.Metadata.Name}
	cidrs := n.Spec.PodCIDRs
	if len(cidrs) == 0 && n.Spec.PodCIDR != "" {
		cidrs = []string{n.Spec.PodCIDR}
	}
	for _, c := range cidrs {
		if _, ipn, err := net.ParseCIDR(c); err == nil && ipn.IP.To4() != nil {
			out.cidrs = append(out.cidrs, ipn.String())
		}
	}
	for _, a := range n.Status.Addresses {
		if ip := net.ParseIP(a.Address); a.Type == "InternalIP" && ip != nil && ip.To4() != nil {
			out.ip = ip.String()
			break
		}
	}
	return out
}

func (a *agent) get(ctx context.Context, path string, query url.Values) (*http.Response, error) {
	token, err := os.ReadFile(filepath.Join(saDir, "token")) // re-read: projected tokens rotate
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.api+path+"?"+query.Encode(), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Accept", "application/json")
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(body))
	}
	return resp, nil
}

func (a *agent) list(ctx context.Context) (string, error) {
	lctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	resp, err := a.get(lctx, "/api/v1/nodes", url.Values{})
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var l struct {
		Metadata struct {
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
		Items []apiNode `json:"items"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
		return "", err
	}
	nodes := map[string]nodeInfo{}
	for _, n := range l.Items {
		nodes[n.Metadata.Name] = n.info()
	}
	a.mu.Lock()
	a.nodes = nodes
	a.mu.Unlock()
	return l.Metadata.ResourceVersion, nil
}

// watch applies Node events until the stream ends; it returns the last resourceVersion
// seen, or "" when the caller must list again (410 Gone or a broken stream).
func (a *agent) watch(ctx context.Context, rv string) (string, error) {
	q := url.Values{"watch": {"true"}, "resourceVersion": {rv}, "timeoutSeconds": {"300"},
		"allowWatchBookmarks": {"true"}}
	resp, err := a.get(ctx, "/api/v1/nodes", q)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	for {
		var ev struct {
			Type   string          `json:"type"`
			Object json.RawMessage `json:"object"`
		}
		if err := dec.Decode(&ev); err != nil {
			if errors.Is(err, io.EOF) {
				return rv, nil // server-side timeout: watch again from rv
			}
			return "", err
		}
		if ev.Type == "ERROR" {
			return "", fmt.Errorf("watch error: %s", ev.Object)
		}
		var n apiNode
		if err := json.Unmarshal(ev.Object, &n); err != nil {
			return "", err
		}
		rv = n.Metadata.ResourceVersion
		if ev.Type == "BOOKMARK" {
			continue
		}
		a.mu.Lock()
		if ev.Type == "DELETED" {
			delete(a.nodes, n.Metadata.Name)
		} else {
			a.nodes[n.Metadata.Name] = n.info()
		}
		a.mu.Unlock()
		a.kick()
	}
}

func (a *agent) listWatchLoop(ctx context.Context) {
	for ctx.Err() == nil {
		rv, err := a.list(ctx)
		if err != nil {
			log.Printf("listing nodes: %v (retrying in 1s)", err)
			sleep(ctx, time.Second)
			continue
		}
		a.kick()
		for rv != "" && ctx.Err() == nil {
			if rv, err = a.watch(ctx, rv); err != nil && ctx.Err() == nil {
				log.Printf("watching nodes: %v (listing again)", err)
				sleep(ctx, time.Second)
			}
		}
	}
}

func (a *agent) kick() {
	select {
	case a.reconcileC <- struct{}{}:
	default:
	}
}

func (a *agent) reconcileLoop(ctx context.Context) {
	t := time.NewTicker(resyncEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.reconcileC:
		case <-t.C:
		}
		a.mu.Lock()
		nodes := make([]nodeInfo, 0, len(a.nodes))
		for _, n := range a.nodes {
			nodes = append(nodes, n)
		}
		a.mu.Unlock()
		if len(nodes) > 0 {
			a.reconcile(nodes)
		}
	}
}

// ---- the node's state -------------------------------------------------------------

func (a *agent) reconcile(nodes []nodeInfo) {
	want := map[string]string{} // pod CIDR -> via
	for _, n := range nodes {
		if n.name == a.self {
			if len(n.cidrs) > 0 {
				if err := a.writeConf(n.cidrs); err != nil {
					log.Printf("writing %s: %v", a.cniConfig, err)
				}
			}
			continue
		}
		if n.ip == "" {
			continue
		}
		for _, c := range n.cidrs {
			want[c] = n.ip
		}
	}
	have, err := ownRoutes()
	if err != nil {
		log.Printf("reading routes: %v", err)
		return
	}
	cidrs := make([]string, 0, len(want))
	for c := range want {
		cidrs = append(cidrs, c)
	}
	sort.Strings(cidrs)
	for _, c := range cidrs {
		if have[c] == want[c] {
			continue
		}
		if out, err := run("ip", "-4", "route", "replace", c, "via", want[c], "proto", routeProto); err != nil {
			log.Printf("ip route replace %s via %s: %v: %s", c, want[c], err, out)
			continue
		}
		if have[c] == "" {
			log.Printf("route %s via %s", c, want[c])
		} else {
			log.Printf("route %s via %s (was via %s)", c, want[c], have[c])
		}
	}
	for c, via := range have {
		if _, ok := want[c]; ok {
			continue
		}
		if out, err := run("ip", "-4", "route", "del", c, "proto", routeProto); err != nil {
			log.Printf("ip route del %s: %v: %s", c, err, out)
			continue
		}
		log.Printf("route %s via %s removed (its node is gone)", c, via)
	}
	var nodeIPs []string
	for _, n := range nodes {
		if n.ip != "" {
			nodeIPs = append(nodeIPs, n.ip)
		}
	}
	sort.Strings(nodeIPs)
	if joined := strings.Join(nodeIPs, ","); joined != a.masqNodes {
		a.masqNodes, a.masqUntil = joined, time.Time{} // a node came or went: now
	}
	if time.Now().After(a.masqUntil) {
		if err := a.ensureMasquerade(nodeIPs); err != nil {
			log.Printf("masquerade rules: %v", err)
		} else {
			a.masqUntil = time.Now().Add(30 * time.Second)
		}
	}
}

// ownRoutes: the routes tagged with our protocol, pod CIDR -> gateway.
func ownRoutes() (map[string]string, error) {
	out, err := run("ip", "-4", "route", "show", "proto", routeProto)
	if err != nil {
		return nil, fmt.Errorf("%v: %s", err, out)
	}
	routes := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "via" && len(f) > 0 {
				routes[f[0]] = f[i+1]
			}
		}
	}
	return routes, nil
}

func (a *agent) writeConf(cidrs []string) error {
	ranges := make([][]map[string]string, 0, len(cidrs))
	for _, c := range cidrs {
		ranges = append(ranges, []map[string]string{{"subnet": c}})
	}
	conf := map[string]any{
		"cniVersion": "0.4.0",
		"name":       "ctj-kind",
		"plugins": []any{
			map[string]any{
				"type":   "ptp",
				"ipMasq": false,
				"mtu":    defaultMTU(),
				"ipam": map[string]any{
					"type": "host-local",
					// /run is a tmpfs: a restarted node container starts with no leases,
					// as it starts with no pods
					"dataDir": "/run/cni-ipam-state",
					"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
					"ranges":  ranges,
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if bytes.Equal(b, a.lastConf) {
		return nil
	}
	if cur, err := os.ReadFile(a.cniConfig); err == nil && bytes.Equal(cur, b) {
		a.lastConf = b
		return nil
	}
	tmp := a.cniConfig + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, a.cniConfig); err != nil {
		return err
	}
	a.lastConf = b
	log.Printf("wrote %s for pod CIDRs %v", a.cniConfig, cidrs)
	return nil
}

// defaultMTU: the MTU of the interface the default route leaves by (1500 if unknown).
func defaultMTU() int {
	out, err := run("ip", "-4", "route", "show", "default")
	if err == nil {
		f := strings.Fields(out)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "dev" {
				if b, err := os.ReadFile("/sys/class/net/" + f[i+1] + "/mtu"); err == nil {
					var mtu int
					if _, err := fmt.Sscan(string(b), &mtu); err == nil && mtu > 0 {
						return mtu
					}
				}
			}
		}
	}
	return 1500
}

// ensureMasquerade: nat POSTROUTING -s <pod subnet> -j CTJ-MASQ; CTJ-MASQ returns for
// destinations in the pod subnets and the nodes' own addresses, and masquerades the rest.
// Nodes route every pod CIDR, so a pod reaching another node (a hostPort there: ctj's node
// agent) needs no masquerade, and keeps its own address: a NetworkPolicy that admits the
// pod by its labels can then see who it is.
func (a *agent) ensureMasquerade(nodeIPs []string) error {
	ipt := func(args ...string) (string, error) {
		return run("iptables", append([]string{"-w", "5", "-t", "nat"}, args...)...)
	}
	if _, err := ipt("-S", masqChain); err != nil {
		if out, err := ipt("-N", masqChain); err != nil {
			return fmt.Errorf("-N %s: %v: %s", masqChain, err, out)
		}
	}
	var body [][]string
	for _, s := range a.podSubnets {
		body = append(body, []string{"-d", s, "-j", "RETURN"})
	}
	for _, ip := range nodeIPs {
		body = append(body, []string{"-d", ip + "/32", "-j", "RETURN"})
	}
	body = append(body, []string{"-j", "MASQUERADE", "--random-fully"})
	ok := rulesIn(ipt, len(body))
	for _, r := range body {
		if _, err := ipt(append([]string{"-C", masqChain}, r...)...); err != nil {
			ok = false
			break
		}
	}
	if !ok {
		if out, err := ipt("-F", masqChain); err != nil {
			return fmt.Errorf("-F: %v: %s", err, out)
		}
		for _, r := range body {
			if out, err := ipt(append([]string{"-A", masqChain}, r...)...); err != nil {
				return fmt.Errorf("-A %v: %v: %s", r, err, out)
			}
		}
		log.Printf("iptables nat %s: masquerade pod traffic leaving %v", masqChain, a.podSubnets)
	}
	for _, s := range a.podSubnets {
		jump := []string{"POSTROUTING", "-s", s, "-m", "comment", "--comment", "ctj-kind-routes", "-j", masqChain}
		if _, err := ipt(append([]string{"-C"}, jump...)...); err != nil {
			if out, err := ipt(append([]string{"-A"}, jump...)...); err != nil {
				return fmt.Errorf("-A %v: %v: %s", jump, err, out)
			}
		}
	}
	return nil
}

// rulesIn: whether CTJ-MASQ holds exactly n rules (a node gone leaves one too many,
// which -C alone would not see).
func rulesIn(ipt func(...string) (string, error), n int) bool {
	out, err := ipt("-S", masqChain)
	if err != nil {
		return false
	}
	count := 0
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "-A "+masqChain) {
			count++
		}
	}
	return count == n
}

func run(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
