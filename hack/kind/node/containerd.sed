# Edits to kind v0.33.0's /etc/containerd/config.toml for these machines (sed script).
# CAP_SYS_RESOURCE is missing from every process's bounding set, so a negative
# oom_score_adj cannot be set and every pod sandbox would fail (/work/shared/CONTAINERS.md):
s/restrict_oom_score_adj = false/restrict_oom_score_adj = true/
# fuse-overlayfs is for rootless kind and is not installed: drop its proxy plugin
/^\[proxy_plugins\]/,/^  address = /d
/^# fuse-overlayfs is used for rootless/d
