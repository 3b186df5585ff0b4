#include "textflag.h"

// func subWord(w uint32) uint32
// AESKEYGENASSIST applies the S-box to dword 1 (among others); dword 0 of the result
// is SubWord(dword 1 of the source). SubWord is byte-wise, so byte order is irrelevant.
TEXT ·subWord(SB), NOSPLIT, $0-12
	MOVL w+0(FP), AX
	MOVQ AX, X0
	PSLLQ $32, X0
	AESKEYGENASSIST $0, X0, X1
	MOVQ X1, AX
	MOVL AX, ret+8(FP)
	RET

// func invMixColumns(dst, src *byte)
TEXT ·invMixColumns(SB), NOSPLIT, $0-16
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVOU (SI), X0
	AESIMC X0, X1
	MOVOU X1, (DI)
	RET

// func encryptCBC(rounds int, xk, iv, dst, src *byte, blocks int)
// Serial by nature: C_i = E(P_i ⊕ C_{i-1}); the loop avoids a call per block.
TEXT ·encryptCBC(SB), NOSPLIT, $0-48
	MOVQ rounds+0(FP), CX
	MOVQ xk+8(FP), AX
	MOVQ iv+16(FP), R9
	MOVQ dst+24(FP), DI
	MOVQ src+32(FP), SI
	MOVQ blocks+40(FP), DX
	MOVOU (R9), X0
	MOVOU (AX), X2

encLoop:
	MOVOU (SI), X1
	PXOR  X1, X0
	PXOR  X2, X0
	LEAQ  16(AX), BX
	MOVQ  CX, R8
	DECQ  R8

encRound:
	MOVOU  (BX), X3
	AESENC X3, X0
	ADDQ   $16, BX
	DECQ   R8
	JNZ    encRound
	MOVOU      (BX), X3
	AESENCLAST X3, X0
	MOVOU      X0, (DI)
	ADDQ       $16, SI
	ADDQ       $16, DI
	DECQ       DX
	JNZ        encLoop
	RET

// func decryptBlocks(rounds int, xk, dst, src *byte, blocks int)
// ECB-decrypts blocks, eight at a time so the AES units stay busy.
TEXT ·decryptBlocks(SB), NOSPLIT, $0-40
	MOVQ rounds+0(FP), CX
	MOVQ xk+8(FP), AX
	MOVQ dst+16(FP), DI
	MOVQ src+24(FP), SI
	MOVQ blocks+32(FP), DX

dec8:
	CMPQ DX, $8
	JB   dec1
	MOVOU 0(SI), X0
	MOVOU 16(SI), X1
	MOVOU 32(SI), X2
	MOVOU 48(SI), X3
	MOVOU 64(SI), X4
	MOVOU 80(SI), X5
	MOVOU 96(SI), X6
	MOVOU 112(SI), X7
	MOVOU (AX), X8
	PXOR  X8, X0
	PXOR  X8, X1
	PXOR  X8, X2
	PXOR  X8, X3
	PXOR  X8, X4
	PXOR  X8, X5
	PXOR  X8, X6
	PXOR  X8, X7
	LEAQ  16(AX), BX
	MOVQ  CX, R8
	DECQ  R8

dec8Round:
	MOVOU  (BX), X8
	AESDEC X8, X0
	AESDEC X8, X1
	AESDEC X8, X2
	AESDEC X8, X3
	AESDEC X8, X4
	AESDEC X8, X5
	AESDEC X8, X6
	AESDEC X8, X7
	ADDQ   $16, BX
	DECQ   R8
	JNZ    dec8Round
	MOVOU      (BX), X8
	AESDECLAST X8, X0
	AESDECLAST X8, X1
	AESDECLAST X8, X2
	AESDECLAST X8, X3
	AESDECLAST X8, X4
	AESDECLAST X8, X5
	AESDECLAST X8, X6
	AESDECLAST X8, X7
	MOVOU      X0, 0(DI)
	MOVOU      X1, 16(DI)
	MOVOU      X2, 32(DI)
	MOVOU      X3, 48(DI)
	MOVOU      X4, 64(DI)
	MOVOU      X5, 80(DI)
	MOVOU      X6, 96(DI)
	MOVOU      X7, 112(DI)
	ADDQ       $128, SI
	ADDQ       $128, DI
	SUBQ       $8, DX
	JMP        dec8

dec1:
	TESTQ DX, DX
	JZ    done
	MOVOU (SI), X0
	MOVOU (AX), X8
	PXOR  X8, X0
	LEAQ  16(AX), BX
	MOVQ  CX, R8
	DECQ  R8

dec1Round:
	MOVOU  (BX), X8
	AESDEC X8, X0
	ADDQ   $16, BX
	DECQ   R8
	JNZ    dec1Round
	MOVOU      (BX), X8
	AESDECLAST X8, X0
	MOVOU      X0, (DI)
	ADDQ       $16, SI
	ADDQ       $16, DI
	DECQ       DX
	JMP        dec1

done:
	RET
