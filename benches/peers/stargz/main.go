// stargz-grpc: stargz-snapshotter's lazy-pulling file system and snapshotter (Debian's
// golang-github-containerd-stargz-snapshotter-dev) served as a containerd proxy snapshotter on
// a unix socket, so that the container benchmark measures the lazy-pull system users would
// otherwise pick on the same machine and link. Debian packages that library and ctr-remote but
// not the daemon; scripts/stargz.sh builds this program against the packaged library.
//
// Layers are found from the labels containerd's CRI plugin passes with each layer it pulls
// (image reference, layer digest, the image's layers), as the upstream daemon does for CRI
// pulls; registries are reached over plain HTTP (the benchmark's registry has no TLS).
//
//	stargz-grpc --address /run/stargz.sock --root /var/lib/stargz [--config stargz.toml]
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/reference"
	"github.com/containerd/containerd/remotes/docker"
	stargzfs "github.com/containerd/stargz-snapshotter/fs"
	fsconfig "github.com/containerd/stargz-snapshotter/fs/config"
	"github.com/containerd/stargz-snapshotter/fs/layer"
	"github.com/containerd/stargz-snapshotter/fs/source"
	snbase "github.com/containerd/stargz-snapshotter/snapshot"
	digest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/pelletier/go-toml"
	"google.golang.org/grpc"
)

// Labels containerd's CRI plugin sets on the snapshot of each layer it pulls.
const (
	imageRefLabel    = "containerd.io/snapshot/cri.image-ref"
	layerDigestLabel = "containerd.io/snapshot/cri.layer-digest"
	imageLayersLabel = "containerd.io/snapshot/cri.image-layers"
)

func main() {
	address := flag.String("address", "/run/stargz-grpc/stargz-grpc.sock", "unix socket to serve on")
	root := flag.String("root", "/var/lib/stargz-grpc", "state and cache directory")
	config := flag.String("config", "", "TOML file of stargz-snapshotter's file system settings (the keys of its config.toml)")
	flag.Parse()
	if err := run(*address, *root, *config); err != nil {
		fmt.Fprintf(os.Stderr, "stargz-grpc: %v\n", err)
		os.Exit(1)
	}
}

// One HTTP client for every registry request (the library takes its transport).
var client = &http.Client{
	Transport: http.DefaultTransport.(*http.Transport).Clone(),
	Timeout:   30 * time.Second,
}

// plainHTTP reaches every registry over HTTP, with no credentials.
func plainHTTP(ref reference.Spec) ([]docker.RegistryHost, error) {
	return []docker.RegistryHost{{
		Client:       client,
		Host:         ref.Hostname(),
		Scheme:       "http",
		Path:         "/v2",
		Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve,
	}}, nil
}

// fromCRILabels names the layer a snapshot is prepared for, and the image's other layers (for
// prefetching), from the CRI plugin's labels.
func fromCRILabels(labels map[string]string) ([]source.Source, error) {
	ref, err := reference.Parse(labels[imageRefLabel])
	if err != nil {
		return nil, fmt.Errorf("label %s: %w", imageRefLabel, err)
	}
	target, err := digest.Parse(labels[layerDigestLabel])
	if err != nil {
		return nil, fmt.Errorf("label %s: %w", layerDigestLabel, err)
	}
	layers := []ocispec.Descriptor{{Digest: target}}
	if all := labels[imageLayersLabel]; all != "" {
		for _, s := range strings.Split(all, ",") {
			d, err := digest.Parse(s)
			if err != nil {
				return nil, fmt.Errorf("label %s: %w", imageLayersLabel, err)
			}
			if d != target {
				layers = append(layers, ocispec.Descriptor{Digest: d})
			}
		}
	}
	return []source.Source{{
		Hosts:    plainHTTP,
		Name:     ref,
		Target:   ocispec.Descriptor{Digest: target},
		Manifest: ocispec.Manifest{Layers: layers},
	}}, nil
}

func run(address, root, configPath string) error {
	var cfg fsconfig.Config
	if configPath != "" {
		tree, err := toml.LoadFile(configPath)
		if err != nil {
			return fmt.Errorf("read %s: %w", configPath, err)
		}
		if err := tree.Unmarshal(&cfg); err != nil {
			return fmt.Errorf("parse %s: %w", configPath, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fs, err := stargzfs.NewFilesystem(filepath.Join(root, "stargz"), cfg,
		stargzfs.WithGetSources(fromCRILabels),
		stargzfs.WithOverlayOpaqueType(layer.OverlayOpaqueTrusted))
	if err != nil {
		return fmt.Errorf("start the file system: %w", err)
	}
	sn, err := snbase.NewSnapshotter(ctx, filepath.Join(root, "snapshotter"), fs, snbase.AsynchronousRemove)
	if err != nil {
		return fmt.Errorf("start the snapshotter: %w", err)
	}
	defer sn.Close()
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return err
	}
	if err := os.Remove(address); err != nil && !os.IsNotExist(err) {
		return err
	}
	l, err := net.Listen("unix", address)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", address, err)
	}
	srv := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(srv, snapshotservice.FromSnapshotter(sn))
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		srv.GracefulStop()
	}()
	return srv.Serve(l)
}
