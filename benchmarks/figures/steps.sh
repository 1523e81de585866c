# Sourced by the figure scripts: `step NAME OUTPUT COMMAND...` runs COMMAND when NAME is in
# $STEPS and OUTPUT does not exist yet, so an interrupted script resumes where it stopped.
step() {
  local name=$1 out=$2
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  if [ -e "$out" ]; then echo "== $name: $out exists, skipped"; return 0; fi
  echo "== $name: $* ($(date -u +%H:%M:%S))"
  "$@"
}
