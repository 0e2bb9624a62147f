# shellcheck shell=bash
# The doctor probe (doctor.probe_command): $1 remote_dir, $2 the host's rsync_path, $3 its
# cuda_home, $4 its python, $5 `import` or `find` (how numpy's version is read), then the selected
# bundles' files relative to remote_dir (capacity.room). Prints the facts the checks need, as
# key=value lines: with the nearest existing folder of remote_dir and its filesystem's free kB,
# MemAvailable's kB and the allocated bytes of each of those files that is there.

d=$1 rsync_path=$2 cuda=$3 py=$4 numpy=$5
shift 5
# the slowest checks start first and run beside the others: the interpreter (its version, then
# numpy's: one process) and nvcc; their lines are printed at the end
exec 5< <("$py" -c 'import sys; print("python_version=%d.%d.%d" % sys.version_info[:3], flush=True)
version = None
if sys.argv[1] == "find":
    try:
        import importlib.util, os
        spec = importlib.util.find_spec("numpy")
        if spec is not None and spec.origin:
            # the one numpy-VERSION.dist-info beside the package names it (importing importlib.metadata costs 20 ms)
            site = os.path.dirname(os.path.dirname(spec.origin))
            found = [n[6:-10] for n in os.listdir(site) if n.startswith("numpy-") and n.endswith(".dist-info")]
            if len(found) == 1:
                version = found[0]
            else:
                import importlib.metadata
                version = importlib.metadata.version("numpy")
    except Exception:       # an older Python, no metadata: the import below tells
        pass
if not version:
    import numpy
    version = numpy.__version__
print("numpy_version=" + version)' "$numpy" 2>/dev/null)
if [ -n "$cuda" ]; then n=$cuda/bin/nvcc; [ -x "$n" ] || n=; else n=$(command -v nvcc); fi
[ -n "$n" ] && exec 6< <(echo "nvcc=$n"; echo "nvcc_version=$("$n" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')")
if [ -n "$rsync_path" ]; then [ -x "$rsync_path" ] && r=$rsync_path; else r=$(command -v rsync); fi
[ -n "$r" ] && echo "rsync=$r" && echo "rsync_version=$("$r" --version 2>/dev/null | head -n1)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu=/'
  apps=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c .)
  [ "${apps:-0}" -gt 0 ] && echo "gpu_busy=yes" || echo "gpu_busy=no"
else
  echo "nvidia_smi=missing"
fi
sed -n 's/^model name[[:space:]]*: */cpu=/p' /proc/cpuinfo 2>/dev/null | head -n1
p=$d; while [ ! -d "$p" ]; do p=$(dirname -- "$p"); done
echo "disk_path=$p"
echo "disk_free_kb=$(df -Pk -- "$p" | awk 'NR==2 {print $4}')"
awk '/^MemAvailable:/ {print "mem_available_kb=" $2}' /proc/meminfo 2>/dev/null
# one stat for every file there (a process each would cost more than the rest of the room);
# it names each file as asked, relative to remote_dir, so a line is never paired with another file
have=()
for f; do [ -f "$d/$f" ] && [ ! -L "$d/$f" ] && have+=("$f"); done
[ ${#have[@]} -gt 0 ] && while read -r blocks block_size f; do
  echo "have_bytes=$((blocks * block_size)) $f"
done < <(cd -- "$d" && exec stat -c '%b %B %n' -- "${have[@]}" 2>/dev/null)
[ -n "$n" ] && cat <&6
cat <&5
exit 0
