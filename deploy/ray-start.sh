#!/usr/bin/env bash
# The start command of every archipelago pod on KubeRay: KubeRay's own `ray start` command plus this
# node's NVLink islands and MIG profiles as Ray resources and labels (`archipelago node-resources`),
# so the planner can pin workers to islands and slices.
#
# The RayCluster sets the annotation ray.io/overwrite-container-cmd: "true"; KubeRay then runs the
# container's command (this script) instead of its own and passes its generated command in
# KUBERAY_GEN_RAY_START_CMD (KubeRay >= 1.1). That command is shell text with KubeRay's quoting
# (e.g. --resources="{\"mig_1g.10gb\": 1}"), so it goes through eval; our flags are JSON and are
# quoted with printf %q so that eval hands them to `ray start` unchanged. A flag given twice keeps
# the last value: node-resources' --resources (the slices this pod really has) wins over a static one.
set -euo pipefail

: "${KUBERAY_GEN_RAY_START_CMD:?is not set: run this as the container command of a RayCluster annotated ray.io/overwrite-container-cmd: \"true\"}"

# Ray opens many sockets and files; KubeRay's own command raises the limit the same way.
ulimit -n 65536 2>/dev/null || echo "ray-start: could not raise the open-file limit to 65536 (hard limit $(ulimit -Hn))" >&2

# A GPU pod whose GPUs cannot be mapped must not join the cluster unplaceable: fail, and the log says
# why (the CLI prints its error on stdout, which $(...) captured).
if ! node_args=$(archipelago node-resources); then
    echo "ray-start: archipelago node-resources failed: $node_args" >&2
    exit 1
fi
read -r -a flags <<< "$node_args"
quoted=""
if ((${#flags[@]})); then
    quoted=$(printf '%q ' "${flags[@]}")
fi
echo "ray-start: $KUBERAY_GEN_RAY_START_CMD $node_args" >&2
eval "exec $KUBERAY_GEN_RAY_START_CMD $quoted"
