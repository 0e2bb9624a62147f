# shellcheck shell=bash
# The sync's last step (sync.py, through state.HostLock.finish_sync), in .kdtree/ under the tree
# lock the client holds alone: the lock command carries it after ownership.sh (run on $1: again,
# since rsync wrote the tree) and runs it when told (host/client.py's finish_sync_request).
# $1 remote_dir, $2 the local tree hash, $3 the command line that hashes the deployed tree (run in
# remote_dir), $4 the deploy record (one line of JSON). Prints the tail of the hash command's
# output (its last @FINISH_TAIL@ bytes, printable) as OUT lines; when its last word is $2, stores the
# record as .kdtree/deploy.json and clears the sync's mark; HASHED and the hash's exit status last.

d=$1 want=$2 record=$4 rc=0
cd -- "$d/.kdtree" || exit 3
out=$( (cd -- "$d" && eval "$3") </dev/null 2>sync.err) || rc=$?
{ printf '%s\n' "$out"; [ "$rc" = 0 ] || cat sync.err; } | tail -c @FINISH_TAIL@ | tr -c '[:print:]\n' ' ' | sed 's/^/OUT /'
rm -f sync.err
if [ "$rc" = 0 ]; then
  read -r -d '' -a words <<< "$out"
  if [ "${#words[@]}" -gt 0 ] && [ "${words[-1]}" = "$want" ]; then
    { printf '%s\n' "$record" > deploy.json.tmp && mv -f deploy.json.tmp deploy.json && rm -f sync.partial; } ||
      { echo "OUT cannot write $d/.kdtree/deploy.json"; rc=1; }
  fi
fi
echo "HASHED $rc"
