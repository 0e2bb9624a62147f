# shellcheck shell=bash
# Arguments: remote_dir, then bundle files relative to it (capacity.probe). Prints the nearest
# existing folder of remote_dir and its filesystem's free kB, MemAvailable's kB, and the allocated
# bytes of each file that is there.

d=$1; shift
p=$d; while [ ! -d "$p" ]; do p=$(dirname -- "$p"); done
echo "disk_path=$p"
echo "disk_free_kb=$(df -Pk -- "$p" | awk 'NR==2 {print $4}')"
awk '/^MemAvailable:/ {print "mem_available_kb=" $2}' /proc/meminfo 2>/dev/null
for f; do
  [ -f "$d/$f" ] && [ ! -L "$d/$f" ] && echo "have_bytes=$(( $(stat -c %b -- "$d/$f") * $(stat -c %B -- "$d/$f") )) $f"
done
exit 0
