# Sourced by tests/gpu_steps.sh: the steps of the GPU scripts. Needs $logs (a folder) and $status
# (0, set to 1 by a failed step).
#
#   step NAME COMMAND...       runs COMMAND into $logs/NAME.log; a failure is printed and recorded
#   sanitize TOOL COMMAND...   compute-sanitizer --tool TOOL COMMAND... as the step sanitizer-TOOL
#   wanted_steps STEP...       checks $GPU_STEPS (default: all the STEPs) names only these; 1 if not
#   wanted STEP                whether $GPU_STEPS names STEP
#   checkout_paths "PATH..."   each path (relative to the checkout, $here) made absolute
#
# compute-sanitizer starts every run with its banner ("COMPUTE-SANITIZER") and ends every run it
# completes with a summary line ("ERROR SUMMARY: ...", "RACECHECK SUMMARY: ..."), findings or none.
# A run that fails after the banner without a summary did not complete: the tool itself stopped (on the H200 it has twice crashed partway, in memcheck and in racecheck, and the
# rerun was clean). `sanitize` then says so, keeps that log as sanitizer-TOOL.incomplete.log and runs
# the step once more; the second run decides. A run with a summary is never repeated.

step() {
  local name=$1; shift
  echo "== $name"
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "   ok"
  else
    echo "   FAILED (see $logs/$name.log)"; tail -30 "$logs/$name.log"; status=1; return 1
  fi
}

sanitize() {
  local tool=$1; shift
  local name="sanitizer-$tool" before=$status
  step "$name" compute-sanitizer --tool "$tool" "$@" && return 0
  grep -q "COMPUTE-SANITIZER" "$logs/$name.log" && ! grep -q "SUMMARY:" "$logs/$name.log" || return 1
  mv "$logs/$name.log" "$logs/$name.incomplete.log"
  echo "   compute-sanitizer stopped without its summary (the tool, not a finding: no report was made);" \
       "its log is $logs/$name.incomplete.log. Running it once more."
  status=$before
  step "$name" compute-sanitizer --tool "$tool" "$@"
}

wanted_steps() {
  local name
  GPU_STEPS=${GPU_STEPS:-$*}
  for name in $GPU_STEPS; do
    case " $* " in *" $name "*) ;; *)
      echo "GPU_STEPS: unknown step '$name' (the steps: $*)" >&2; return 1 ;;
    esac
  done
}

wanted() {
  case " $GPU_STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac
}

checkout_paths() {
  local path
  for path in $1; do echo "$here/$path"; done
}
