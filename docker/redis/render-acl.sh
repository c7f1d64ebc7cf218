#!/bin/sh
# Render ACL file templates, concatenated, on stdout: every ${NAME} becomes the value of
# environment variable NAME, copied literally (a password may hold any character but
# whitespace, which the ACL file syntax cannot carry). A variable that is unset or empty, or a
# value with whitespace, is an error naming the variable (never its value); nothing is printed.
#   render-acl.sh users.acl.template admin.acl.template > users.acl
set -eu
[ $# -ge 1 ] || { echo "usage: render-acl.sh TEMPLATE..." >&2; exit 2; }
awk '
function render(line,    out, start, len, name, value) {
    out = ""
    while ((start = index(line, "${")) > 0) {
        len = index(substr(line, start), "}")
        if (len == 0) break
        name = substr(line, start + 2, len - 3)
        value = ENVIRON[name]
        if (value == "") {
            printf "render-acl: %s is not set\n", name > "/dev/stderr"; bad = 1
        } else if (value ~ /[ \t]/) {
            printf "render-acl: %s contains whitespace\n", name > "/dev/stderr"; bad = 1
        }
        out = out substr(line, 1, start - 1) value
        line = substr(line, start + len)
    }
    return out line
}
{ lines[NR] = render($0) }
END {
    if (bad) exit 1
    for (i = 1; i <= NR; i++) print lines[i]
}
' "$@"
